"""Child processes that die with their parent, and killing a process's whole session."""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import IO, Protocol, TypeVar, runtime_checkable

PR_SET_PDEATHSIG = 1


class Proc(Protocol):
    """A trainer process: a Popen, or a child of the fork server (tasks/providers/local/fork_server.py)."""

    pid: int
    returncode: int | None
    stdout: IO[str] | None
    stderr: IO[str] | None

    def wait(self, timeout: float | None = None) -> int: ...


@runtime_checkable
class SaysExited(Protocol):
    """A process that is not this process's child (a fork server's, fork_server.ForkedProcess): it says
    itself whether it exited, where `waitid` cannot."""

    def exited(self) -> bool: ...


def exited(proc: Proc) -> bool:
    """Whether the trainer has exited, without reaping it (WNOWAIT)."""
    if proc.returncode is not None:
        return True
    if isinstance(proc, SaysExited):
        return proc.exited()
    try:
        return os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:  # reaped by a concurrent release()
        return True


def signal_group(pid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, sig)


def kill_leftovers(proc: Proc) -> None:
    """SIGKILL every process in the trainer's session, unless the leader is reaped (its id may be reused)."""
    if proc.returncode is not None:
        return
    sid = proc.pid
    signal_group(sid, signal.SIGKILL)
    if not os.path.isdir("/proc"):
        return
    for entry in os.listdir("/proc"):  # data-loader workers are in their own process groups
        if entry.isdigit():
            try:
                if os.getsid(int(entry)) == sid:
                    os.kill(int(entry), signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                continue


_T = TypeVar("_T")
_spawner: ThreadPoolExecutor | None = None
_spawner_lock = threading.Lock()


def on_spawner_thread(start: Callable[[], _T]) -> _T:
    """Run `start` (a Popen with die_with_parent()) on one thread that lives as long as the process:
    PR_SET_PDEATHSIG fires when the *thread* that forked the child ends, so a short-lived task thread
    must not be the one that starts a trainer."""
    global _spawner
    with _spawner_lock:
        if _spawner is None:
            _spawner = ThreadPoolExecutor(max_workers=1, thread_name_prefix="spotrun-spawner")
    return _spawner.submit(start).result()


def die_with_parent() -> Callable[[], None] | None:
    """A preexec_fn setting PR_SET_PDEATHSIG=SIGKILL (Linux). Everything is resolved here, in the parent,
    so the child runs as little Python as possible between fork and exec."""
    if not sys.platform.startswith("linux"):
        return None
    prctl = ctypes.CDLL(None, use_errno=True).prctl
    parent, sigkill = os.getpid(), int(signal.SIGKILL)

    def set_pdeathsig() -> None:
        if prctl(PR_SET_PDEATHSIG, sigkill, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
        if os.getppid() != parent:  # the parent died before prctl: no signal would ever come
            os._exit(1)

    return set_pdeathsig
