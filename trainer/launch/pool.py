"""The fork server's side of a pool (`provider.pool: NAME`): one server shared by every controller of
this user on the host that names the pool, reached through a Unix socket in a 0700 directory.

The controller that finds no server binds the socket (holding the pool's lock file, so that two
starting at once end with one server) and hands it to `python -P -m spotrun.trainer.launch.zygote --pool`,
which leaves its starter at once: it outlives the controller that started it. It serves only peers of
its own uid (SO_PEERCRED), kills the trainers of a connection that closes (a controller that dies still
takes its trainers along), and ends once it has had no request and no trainer for `idle_s`, or when
asked to stop and its last trainer is gone. The client's side is tasks/providers/local/pool.py.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import select
import signal
import socket
import struct
from dataclasses import dataclass

_UCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


@dataclass
class Pool:
    """The listening socket of a pool server and the files beside it."""

    listener: socket.socket | None
    path: str  # the socket's file
    lock: str  # the lock file starters and the server's own exit hold
    idle_s: float
    key: tuple[str, tuple[tuple[str, str], ...]]  # the load key it serves (zygote.load_key)
    inode: int = 0  # the socket file's, at start: a server never unlinks a successor's

    def __post_init__(self) -> None:
        with contextlib.suppress(OSError):
            self.inode = os.stat(self.path).st_ino

    def close(self) -> None:
        """Stop listening and remove the socket file, if it is still this server's; under the lock, so
        that no starter is between a failed connect and its bind."""
        if self.listener is None:
            return
        fd = os.open(self.lock, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            self._unlink()
        finally:
            os.close(fd)

    def close_if_unasked(self) -> bool:
        """At the idle end: stop listening unless a starter holds the lock or a connection waits to be
        accepted (both come from a controller that means to ask); True once closed."""
        if self.listener is None:
            return True
        fd = os.open(self.lock, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return False
            if select.select([self.listener], [], [], 0)[0]:
                return False
            self._unlink()
            return True
        finally:
            os.close(fd)

    def _unlink(self) -> None:
        with contextlib.suppress(OSError):
            if os.stat(self.path).st_ino == self.inode:
                os.unlink(self.path)
        if self.listener is not None:
            self.listener.close()
            self.listener = None


def peer_uid(sock: socket.socket) -> int:
    """The uid of the process at the other end of a Unix socket (SO_PEERCRED, Linux)."""
    _pid, uid, _gid = _UCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size))
    return int(uid)


def peer_refusal(peer: int, own: int) -> str | None:
    """None for a peer of this server's own uid; else the one line it is refused with. The directory is
    0700 already: this holds if someone loosens it, or root hands the socket on."""
    if peer == own:
        return None
    return f"this trainer pool serves uid {own} only (the caller is uid {peer}); start your own pool"


def kill_session(sid: int) -> None:
    """SIGKILL every process in session `sid` (a trainer's: data-loader workers leave its group)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(sid, signal.SIGKILL)
    if not os.path.isdir("/proc"):
        return
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                if os.getsid(int(entry)) == sid:
                    os.kill(int(entry), signal.SIGKILL)
