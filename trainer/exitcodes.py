"""Exit codes of `python -m spotrun.trainer`, and the completion marker that backs them up.

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
    # another live trainer holds the storage lease (trainer/preemption/lease.py): two writers would corrupt
    # each other; stop that run or wait until its lease expires. Nothing was published.
    LEASE_HELD = 5
    # the lease was taken over by another worker while this one trained; it stopped without publishing
    # more. Retrying would only fight the new holder. (A lease that merely ran out unrenewed exits CRASHED.)
    LEASE_LOST = 6
    # EX_TEMPFAIL: stopped on a notice/SIGTERM after an emergency checkpoint became durable, or without
    # one when the notice's deadline left too little time (the `stopping` status record says why)
    PREEMPTED = 75

    @property
    def retryable(self) -> bool:
        return self in (ExitCode.CRASHED, ExitCode.PREEMPTED)
