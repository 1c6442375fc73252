"""Exit codes of `python -m trainer`, and the completion marker that backs them up.

An exit code alone can lie: a SIGTERM that lands during interpreter teardown yields -15 after all
work was done, and torchrun returns 1 on SIGTERM even when its workers exited 0. Orchestrators
decide "completed" from COMPLETED.json under the storage root, and use the code for the rest.
"""

from __future__ import annotations

from enum import IntEnum


class ExitCode(IntEnum):
    COMPLETED = 0  # final checkpoint durable and COMPLETED.json written
    CRASHED = 1  # unexpected error (also Python's code for an uncaught exception): retry from a checkpoint
    # bad job spec, unknown recipe, incompatible checkpoint, missing bucket or credentials: fix, don't retry
    CONFIG_ERROR = 2
    DIVERGED = 3  # loss became NaN/Inf: a retry from the same checkpoint will likely repeat it
    STOPPED = 4  # reached --max-steps before the end; checkpoint durable, run again to continue
    # EX_TEMPFAIL: stopped on a notice/SIGTERM after an emergency checkpoint became durable, or without
    # one when the notice's deadline left too little time (the `stopping` status record says why)
    PREEMPTED = 75

    @property
    def retryable(self) -> bool:
        return self in (ExitCode.CRASHED, ExitCode.PREEMPTED)
