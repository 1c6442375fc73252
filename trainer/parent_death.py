"""SIGKILL this process when its parent dies (PR_SET_PDEATHSIG): the trainer's launcher, its ranks, its
checkpoint writer and the fork server's children all arm it the same way. Linux only; elsewhere a no-op."""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal

PR_SET_PDEATHSIG = 1


def arm_pdeathsig() -> None:
    """Have the kernel SIGKILL this process when the thread that forked it ends. Safe between fork and
    exec (a preexec_fn); a platform without prctl leaves the process as it is."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)


def die_with(parent: int, code: int) -> None:
    """Arm the parent-death signal against `parent` (its pid, read before this process could have been
    orphaned), and exit with `code` at once if it is already gone: a death before the arming sends
    nothing."""
    arm_pdeathsig()
    if os.getppid() != parent:
        os._exit(code)
