"""Stop requests: SIGTERM and cloud interruption notices end in the same place, a flag the
training loop reads at the next step boundary (a handler that checkpoints itself would run in
the middle of a step, with the optimizer half-applied).

A notice may carry a deadline (the moment the machine goes away). At the boundary the loop asks
`plan_emergency_save` whether a checkpoint can still become durable in time; one that cannot is
not started, and the last durable checkpoint stands.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from dataclasses import dataclass
from types import FrameType

log = logging.getLogger(__name__)

MB = 1e6
# Before any checkpoint was timed: slower than a local disk or S3 from inside AWS, so a first-save
# estimate errs towards skipping a save that could not have finished.
DEFAULT_WRITE_BPS = 25 * MB
DEFAULT_UPLOAD_BPS = 25 * MB


class StopRequest:
    """Thread-safe: notice watchers run in threads, SIGTERM in the main thread's handler."""

    def __init__(self) -> None:
        self._event = threading.Event()
        self.reason: str | None = None
        self.received_at: float | None = None
        self.deadline: float | None = None  # epoch seconds the machine goes away, when a notice says
        self.count = 0  # requests so far: a second one ends a handover (trainer/preemption/handover.py)

    def notice(self, reason: str, deadline: float | None = None) -> None:
        """Ask the loop to checkpoint and stop; the first reason wins, the earliest deadline wins."""
        # Deadline before the flag: a loop that sees the flag must also see the deadline.
        if deadline is not None and (self.deadline is None or deadline < self.deadline):
            self.deadline = deadline
        self.count += 1
        if not self._event.is_set():
            self.reason, self.received_at = reason, time.time()
            self._event.set()

    @property
    def requested(self) -> bool:
        return self._event.is_set()


def install_signal_handlers(stop: StopRequest) -> None:
    """SIGTERM (spot notices, `kill`, Kubernetes) and SIGINT both become a stop request."""

    def handler(signum: int, _frame: FrameType | None) -> None:
        stop.notice(signal.Signals(signum).name)

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)


@dataclass(frozen=True)
class SavePlan:
    save: bool
    estimate_s: float  # seconds until the emergency checkpoint would be durable
    reason: str  # "needs ~14.2 s (120.0 MB at 8.5 MB/s), 6.0 s left", for the log and status line


def plan_emergency_save(
    state_bytes: int,
    write_bps: float,
    upload_bps: float,
    *,
    now: float,
    deadline: float,
    margin_s: float,
    measured: bool = True,
    in_flight: bool = False,
) -> SavePlan:
    """Whether an emergency checkpoint can be durable `margin_s` before `deadline`.

    Writing and uploading (with read-back) run one after the other, so their times add. A checkpoint
    still in flight must finish first (one at a time) and counts as a second copy. A save that cannot
    finish is not worth starting: the machine dies mid-upload, and the partial write is ignored anyway.
    """
    if write_bps <= 0 or upload_bps <= 0:
        raise ValueError("bandwidths must be positive")
    copies = 2 if in_flight else 1
    estimate = copies * (state_bytes / write_bps + state_bytes / upload_bps)
    left = deadline - now
    rate = 1 / (1 / write_bps + 1 / upload_bps)
    notes = (" + the checkpoint in flight" if in_flight else "") + (
        "" if measured else "; default bandwidth, nothing measured yet"
    )
    size = f"{state_bytes / MB:.1f} MB at {rate / MB:.1f} MB/s{notes}"
    what = f"needs ~{estimate:.1f} s ({size}), {left:.1f} s left"
    if estimate + margin_s <= left:
        return SavePlan(True, estimate, what)
    return SavePlan(False, estimate, f"{what}, margin {margin_s:g} s")
