"""What one attempt was and how it ended: the record the flow classifies, decides on and stores.

Pure data and pure functions; no Prefect here (the task wrappers live beside them).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from enum import StrEnum
from typing import Any

# An attempt's `extra` key set when the market policy ended it to move the job back to spot (its value:
# the market moved to). Such an attempt is PREEMPTED but draws on no budget and counts as no reclaim.
MARKET_MOVE = "market_move"


class Outcome(StrEnum):
    COMPLETED = "completed"  # the completion marker exists (not just exit code 0)
    PREEMPTED = "preempted"  # a notice / SIGTERM, or a hard kill after (or without) a spot notice
    CRASHED = "crashed"  # non-zero exit or signal without a notice: bug, OOM, NaN, storage
    LOST = "lost"  # no heartbeat for the configured time; the worker was killed
    HUNG = "hung"  # the progress watchdog's start-up, step or save timeout fired; the worker was killed
    ROLLED_BACK = "rolled_back"  # a loss spike: killed, its newer checkpoints quarantined, resumed before it
    PROVISION_FAILED = "provision_failed"  # no worker could be started
    CANCELLED = "cancelled"  # the controller stopped it: a cancel, Ctrl-C, or the controller's own end


@dataclass
class AttemptRecord:
    """One attempt, as the SQL table `attempts` stores it (append-only)."""

    attempt: int
    worker_id: str
    provider: str
    started_at: float  # epoch seconds
    ended_at: float
    outcome: Outcome
    cause: str  # one line: "spot notice (SIGTERM), exited PREEMPTED", "SIGKILL without notice", ...
    exit_code: int | None = None  # the process exit code; None when killed by a signal
    signal: int | None = None  # the signal that ended it
    trainer_code: str | None = None  # the trainer's own ExitCode name from its last status line
    error: str = ""  # error summary (exception type and message)
    log_tail: str = ""  # the last lines of the worker's log
    resumed_from: int | None = None  # checkpoint step this attempt started from (None: scratch)
    resumed_checkpoint: str | None = None  # its URI
    last_step: int = 0  # highest step the worker reported
    last_durable_step: int | None = None  # newest checkpoint it reported durable
    lost_steps: int = 0  # steps done after the last durable checkpoint (recomputed later)
    notice_lead_s: float | None = None  # seconds from the notice to the worker's end
    wall_s: float = 0.0
    productive_s: float = 0.0  # wall time whose steps ended in a durable checkpoint
    extra: dict[str, Any] = field(default_factory=dict)

    def to_row(self) -> dict[str, Any]:
        d = asdict(self)
        d["outcome"] = self.outcome.value
        return d
