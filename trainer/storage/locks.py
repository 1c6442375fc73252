"""Lock files that never block forever, and the private umask of SPOTRUN_HOME.

A lock is an exclusive `flock` on a file that is never deleted: the kernel releases it when its holder
dies, so only a live holder can keep it, and a wait for it is bounded: past the bound the holder is
stuck (or another user's), and the waiter says so in one line instead of hanging.
"""

from __future__ import annotations

import fcntl
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from spotrun.trainer.errors import SpotrunError

POLL_S = 0.1
PRIVATE_UMASK = 0o077  # files 0600, directories 0700


class LockTimeout(SpotrunError):
    """Another process held a lock file longer than the caller waits; the message names it and its pid."""


def flock_waiting(fd: int, timeout_s: float, poll_s: float = POLL_S) -> bool:
    """Take an exclusive flock on `fd`, polling for at most `timeout_s`; False when it stayed held."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(poll_s)


@contextmanager
def flock_within(path: Path, timeout_s: float, what: str) -> Iterator[None]:
    """Hold an exclusive flock on `path` (created 0600 if absent, never deleted) for the body; wait at
    most `timeout_s` for it, then raise LockTimeout naming `what`, the file and the holder's pid."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        if not flock_waiting(fd, timeout_s):
            raise LockTimeout(
                f"{what}: {path} has been held for {timeout_s:.0f} s by {_holder(fd)}; wait for it "
                "to finish, or end that process"
            )
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)  # for the next waiter's message
        yield
    finally:
        os.close(fd)  # releases the lock


def _holder(fd: int) -> str:
    try:
        pid = int(os.pread(fd, 32, 0).split()[0])
    except (OSError, ValueError, IndexError):
        return "another process"
    return f"pid {pid}"


def private_home(home: Path) -> None:
    """What this process (and every process it starts) creates from now on is private (umask 077: a
    new SPOTRUN_HOME is 0700, its files 0600), and an existing `home` of this user becomes 0700. Called
    once at each entry point, before anything is written; creates nothing. A checkpoint store
    elsewhere keeps its own directory's mode: the local store gives what it creates that mode."""
    os.umask(PRIVATE_UMASK)
    try:
        st = home.stat()
    except OSError:
        return  # made later, under the umask
    if st.st_uid == os.getuid() and st.st_mode & 0o077:
        home.chmod(0o700)  # a home made before this version: its contents become unreachable to others
