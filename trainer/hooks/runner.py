"""Run one hook: a user's command with a timeout, its output's tail and exit code kept, never raising.

Shared by the worker (trainer/hooks/worker.py) and the controller (tasks/control/hooks.py), so both
record a hook the same way. A hook runs as argv (no shell) in a session of its own: the trainer's
signals (a notice's SIGTERM to its process group) do not reach it, a timeout kills its whole process
group (a `sh -c` and its children alike), and it dies with the process that started it (PR_SET_PDEATHSIG).
What a hook leaves running in its group when it exits is killed too: the worker is going away.
A hook that cannot start, fails or hangs is recorded, never raised: it does not change the attempt's end.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shlex
import signal
import subprocess
import threading
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import IO, Any

from spotrun.trainer.parent_death import arm_pdeathsig

log = logging.getLogger(__name__)

TAIL_BYTES = 4000  # the output kept: the end, where a failing command says why
READER_GRACE_S = 1.0  # after the hook exits, how long its output may take to drain
STILL_RUNNING_EVERY_S = 10.0  # a log line while a hook runs: a supervisor reads silence as a hang


@dataclass(frozen=True)
class HookRun:
    """What one hook did: as the `hook` status record and the attempt row's `extra.hooks` hold it."""

    event: str  # on_preempt | on_stop | on_complete | on_attempt_end
    command: str  # shlex.join of its argv
    code: int | None  # its exit code; None when it did not start, was killed, or was skipped
    timed_out: bool  # killed at its timeout (the whole process group)
    duration_s: float
    timeout_s: float
    output: str  # the tail of stdout and stderr together
    error: str = ""  # why it did not start, or was skipped

    @property
    def ok(self) -> bool:
        return self.code == 0

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def summary(self) -> str:
        """One line for a log: `on_stop (python x.py): exit 3 in 0.12 s`."""
        if self.error:
            how = self.error
        elif self.timed_out:
            how = f"killed at its {self.timeout_s:g} s timeout"
        else:
            how = f"exit {self.code}"
        return f"{self.event} ({self.command}): {how} after {self.duration_s:.2f} s"


def run_hook(event: str, argv: list[str], *, env: Mapping[str, str], timeout_s: float) -> HookRun:
    """Run `argv` with `env` for at most `timeout_s` seconds (not positive: skipped, recorded why)."""
    command = shlex.join(argv)
    if timeout_s <= 0:
        return _unrun(event, command, timeout_s=timeout_s, error="skipped: no time left")
    t0 = time.monotonic()
    try:
        proc = subprocess.Popen(
            argv,
            env=dict(env),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # a group of its own: killed whole, spared the trainer's signals
            preexec_fn=arm_pdeathsig,
        )
    except (OSError, subprocess.SubprocessError) as e:
        return _unrun(event, command, timeout_s=timeout_s, error=f"cannot start: {e}", since=t0)
    tail = _Tail()
    assert proc.stdout is not None
    reader = threading.Thread(
        target=tail.read, args=(proc.stdout,), name=f"spotrun-hook-{event}", daemon=True
    )
    reader.start()
    code, timed_out = _wait(proc, event, timeout_s=timeout_s, t0=t0)
    _kill_group(proc.pid)  # at the timeout: the hook; after an exit: what it left running in its group
    proc.wait()
    reader.join(READER_GRACE_S)  # a process outside the group may still hold the pipe: not waited for
    return HookRun(
        event,
        command,
        code=code,
        timed_out=timed_out,
        duration_s=time.monotonic() - t0,
        timeout_s=timeout_s,
        output=tail.text(),
    )


def _unrun(event: str, command: str, *, timeout_s: float, error: str, since: float | None = None) -> HookRun:
    """The record of a hook that did not run: skipped, or it could not start."""
    took = 0.0 if since is None else time.monotonic() - since
    return HookRun(
        event,
        command,
        code=None,
        timed_out=False,
        duration_s=took,
        timeout_s=timeout_s,
        output="",
        error=error,
    )


def _wait(
    proc: subprocess.Popen[bytes], event: str, *, timeout_s: float, t0: float
) -> tuple[int | None, bool]:
    """(exit code, timed out): waits in slices, logging while the hook runs on."""
    deadline = t0 + timeout_s
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            log.warning("hook %s still running after %g s: killing its process group", event, timeout_s)
            return None, True
        try:
            return proc.wait(timeout=min(left, STILL_RUNNING_EVERY_S)), False
        except subprocess.TimeoutExpired:
            log.info("hook %s running for %.0f s (timeout %g s)", event, time.monotonic() - t0, timeout_s)


def _kill_group(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


class _Tail:
    """The last TAIL_BYTES of a stream, read in a thread (a pipe nobody reads blocks its writer)."""

    def __init__(self) -> None:
        self._buf = bytearray()
        self._lock = threading.Lock()

    def read(self, pipe: IO[bytes]) -> None:
        with pipe:
            while chunk := pipe.read1(65536) if hasattr(pipe, "read1") else pipe.read(65536):
                with self._lock:
                    self._buf += chunk
                    del self._buf[:-TAIL_BYTES]

    def text(self) -> str:
        with self._lock:
            return bytes(self._buf).decode("utf-8", errors="replace")
