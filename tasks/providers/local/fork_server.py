"""The local provider's side of the trainer fork server (trainer/launch/zygote.py):
start one, ask it for trainers.

A server is kept per interpreter and *load-time environment*: the variables a process reads once at
start-up (`PYTHON*`, OpenMP's and BLAS's thread settings, `LD_*`, locale, torch's import-time switches).
A child forked from a server whose start-up saw other values would differ from the fresh process it
replaces, so a request whose values differ gets another server. Everything else (SPOTRUN_*, credentials,
the working directory, argv) is the child's own, set after the fork.

Servers live as long as this process: they die with it (PR_SET_PDEATHSIG) and their trainers with them.
A pool's server (pool.py) is shared by the controllers of a host and outlives them; a controller's
trainers still die with its connection.
A server that dies or cannot start is not an error: the provider starts that trainer as a fresh process.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import os
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Mapping, Sequence
from typing import IO, Any

from spotrun.tasks.providers.processes import die_with_parent, on_spawner_thread
from spotrun.trainer.interpreter import python_m
from spotrun.trainer.launch.zygote import MAX_PACKET, LoadKey, load_key, send

log = logging.getLogger(__name__)

# What the trainer imports before it can train a step: torch (1.9 s on a 2-core VM), torch._dynamo (1.25 s;
# the first optimizer step imports it) and the training stack (0.3 s). Recipes stay per child: a user's
# recipe module may change between runs, and the built-in ones import in milliseconds.
PRELOAD = ("torch", "torch._dynamo", "spotrun.trainer.__main__")
READY_TIMEOUT_S = 120.0  # the imports on a cold page cache of a slow disk
SPAWN_TIMEOUT_S = 30.0


class ForkServerUnavailable(Exception):
    """No trainer from a fork server this time (it failed to start, died or refused); start a fresh one."""


class ServerConnection:
    """The client's end of one fork server's socket (a private server's, or a pool's: pool.py) and the
    thread that reads its packets."""

    def __init__(self, sock: socket.socket, python: str, proc: subprocess.Popen[bytes] | None = None) -> None:
        self.sock, self.python, self.proc = sock, python, proc
        self.ready_s: float | None = None
        self.hello: dict[str, Any] = {}  # the server's `ready` packet
        self._cond = threading.Condition()
        self._ready = False
        self._dead: str | None = None
        self._replies: dict[int, dict[str, Any]] = {}
        self._exits: dict[int, int] = {}
        self._children: set[int] = set()  # forked and not reaped yet
        self._ids = itertools.count(1)
        self._send_lock = threading.Lock()
        self._reader = threading.Thread(target=self._read, name="spotrun-fork-server", daemon=True)
        self._reader.start()

    @property
    def pid(self) -> int:
        """The server's process id (a pool's says it once ready)."""
        return self.proc.pid if self.proc is not None else int(self.hello.get("pid", 0))

    @property
    def alive(self) -> bool:
        with self._cond:
            return self._dead is None

    def wait_ready(self, timeout: float = READY_TIMEOUT_S) -> float:
        """Seconds the server's imports took, once it serves; ForkServerUnavailable if it never will."""
        with self._cond:
            if not self._cond.wait_for(lambda: self._ready or self._dead is not None, timeout):
                self._dead = f"not ready after {timeout:g} s"
            if self._dead is not None:
                raise ForkServerUnavailable(self._dead)
        return self.ready_s or 0.0

    def spawn(self, module: str, argv: Sequence[str], env: Mapping[str, str], cwd: str) -> ForkedProcess:
        """A child running `python -P -m module *argv` in `cwd`, its stdout and stderr read through new
        pipes. Its sys.path is the server's: `env`'s PYTHONPATH is the server's (a load-time variable)."""
        self.wait_ready()
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        try:
            rid = next(self._ids)
            msg = {
                "op": "spawn",
                "id": rid,
                "module": module,
                "argv": list(argv),
                "env": dict(env),
                "cwd": cwd,
            }
            with self._send_lock:
                send(self.sock, msg, [out_w, err_w])
            reply = self._reply(rid)
        except BaseException:
            for fd in (out_r, err_r):
                os.close(fd)
            raise
        finally:
            os.close(out_w)
            os.close(err_w)
        if "pid" not in reply:
            for fd in (out_r, err_r):
                os.close(fd)
            raise ForkServerUnavailable(str(reply.get("error", reply)))
        args = python_m(module, *argv, python=self.python)  # what the fresh process would have run
        return ForkedProcess(self, int(reply["pid"]), _text(out_r), stderr=_text(err_r), args=args)

    def exit_code(self, pid: int) -> int | None:
        """The child's return code once it has exited (it is not reaped yet), else None."""
        with self._cond:
            return self._exits.get(pid)

    def wait_exit(self, pid: int, timeout: float | None) -> int:
        with self._cond:
            if not self._cond.wait_for(lambda: pid in self._exits, timeout):
                raise subprocess.TimeoutExpired(f"trainer pid {pid}", timeout or 0)
            return self._exits[pid]

    def reap(self, pid: int) -> None:
        """Have the server reap an exited child; returns once it has (as Popen.wait does)."""
        with self._cond:
            if self._dead is not None:
                self._exits.pop(pid, None)
                self._children.discard(pid)
                return
        with self._send_lock, contextlib.suppress(OSError):
            send(self.sock, {"op": "reap", "pid": pid})
        with self._cond:
            self._cond.wait_for(lambda: pid not in self._children or self._dead is not None, SPAWN_TIMEOUT_S)
            self._exits.pop(pid, None)
            self._children.discard(pid)

    def close(self) -> None:
        """Close the connection: a private server stops, a pool's kills this connection's trainers
        (SIGKILL either way, as when this process dies)."""
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        if self.proc is None:
            self._reader.join(timeout=10)
            return
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=10)
        if self.proc.returncode is None:
            self.proc.kill()
            self.proc.wait()

    def _reply(self, rid: int) -> dict[str, Any]:
        with self._cond:
            self._cond.wait_for(lambda: rid in self._replies or self._dead is not None, SPAWN_TIMEOUT_S)
            if rid in self._replies:
                reply = self._replies.pop(rid)
                if "pid" in reply:
                    self._children.add(int(reply["pid"]))
                return reply
            raise ForkServerUnavailable(self._dead or f"no answer to a spawn within {SPAWN_TIMEOUT_S:g} s")

    def _read(self) -> None:
        why = "the fork server exited"
        try:
            while True:
                data = self.sock.recv(MAX_PACKET)
                if not data:
                    break
                self._handle(json.loads(data))
        except (OSError, ValueError) as e:
            why = f"the fork server's socket failed: {e}"
        if self.proc is not None:
            why = f"{why} (exit code {self.proc.wait()})"
        with self._cond:
            self._dead = why
            for pid in self._children:  # they got SIGKILL with the server (PR_SET_PDEATHSIG)
                self._exits.setdefault(pid, -int(signal.SIGKILL))
            self._cond.notify_all()
        self.sock.close()

    def _handle(self, msg: dict[str, Any]) -> None:
        with self._cond:
            op = msg.get("op")
            if op == "ready":
                self._ready, self.ready_s, self.hello = True, float(msg.get("preload_s", 0)), msg
            elif op == "spawned":
                self._replies[int(msg["id"])] = msg
            elif op == "exited":
                self._exits[int(msg["pid"])] = int(msg["returncode"])
            elif op == "reaped":
                self._children.discard(int(msg["pid"]))
            elif op == "error":
                self._dead = str(msg.get("error"))

            self._cond.notify_all()


class ForkServer(ServerConnection):
    """A private server: a trainer/launch/zygote.py process of this process's, over a socketpair."""

    def __init__(self, python: str, env: Mapping[str, str], preload: Sequence[str] = PRELOAD) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        cmd = python_m(
            "spotrun.trainer.launch.zygote", str(theirs.fileno()), ",".join(preload), python=python
        )
        try:
            proc = on_spawner_thread(lambda: _popen(cmd, dict(env), theirs.fileno()))
        finally:
            theirs.close()
        super().__init__(ours, python, proc)


class ForkedProcess:
    """A trainer forked by a ForkServer, with the part of Popen's interface the local provider uses."""

    def __init__(
        self, server: ServerConnection, pid: int, stdout: IO[str], *, stderr: IO[str], args: list[str]
    ) -> None:
        self.server, self.pid = server, pid
        # Popen's `args`: the resume check finds the trainer's --metrics file there (tasks/tracking);
        # without it a forked trainer's lost steps were never read from the file, only from status records
        self.args = args
        self.stdout: IO[str] | None = stdout
        self.stderr: IO[str] | None = stderr
        self.returncode: int | None = None

    def exited(self) -> bool:
        """Whether it has exited; it stays unreaped (its session id is not reused) until `wait`."""
        return self.returncode is not None or self.server.exit_code(self.pid) is not None

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            rc = self.server.wait_exit(self.pid, timeout)
            self.server.reap(self.pid)
            self.returncode = rc
        return self.returncode


_servers: dict[LoadKey, ForkServer] = {}
_servers_lock = threading.Lock()


def server_for(python: str, env: Mapping[str, str], preload: Sequence[str] = PRELOAD) -> ForkServer:
    """This process's server for `python` and `env`'s load-time variables, started if there is none."""
    key = load_key(python, env)
    with _servers_lock:
        server = _servers.get(key)
        if server is None or not server.alive:
            server = _servers[key] = ForkServer(python, env, preload)
            log.info("started a trainer fork server (pid %d) for %s", server.pid, python)
    return server


def spawn(
    python: str,
    module: str,
    argv: Sequence[str],
    *,
    env: Mapping[str, str],
    cwd: str | os.PathLike[str],
    preload: Sequence[str] | None = None,
) -> ForkedProcess:
    """`python -P -m module *argv` in `cwd`, forked from this process's server for (python, env), which
    imports `preload` (default PRELOAD) when it starts."""
    t = time.monotonic()
    server = server_for(python, env, PRELOAD if preload is None else preload)
    proc = server.spawn(module, argv, env, os.fspath(cwd))
    log.debug("forked trainer pid %d in %.2f s", proc.pid, time.monotonic() - t)
    return proc


def _text(fd: int) -> IO[str]:
    return open(fd, encoding="utf-8", errors="replace")


def _popen(cmd: list[str], env: dict[str, str], fd: int) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        cmd,
        pass_fds=(fd,),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,  # the server prints nothing; its children get their own pipes
        env=env,
        start_new_session=True,  # a terminal's Ctrl-C is the controller's to handle, not the server's
        preexec_fn=die_with_parent(),
    )
