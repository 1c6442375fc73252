"""When a stopping trainer may stop, and whether it takes an emergency checkpoint on the way out.

Two separate decisions at the step boundary after a stop request (a SIGTERM, a cloud notice):
- the handover gate: a noticed single process trains on until its replacement stands by, the
  handover's time is up, or a second stop request comes (trainer/preemption/handover.py has the protocol);
- the emergency plan: with a deadline, take the last checkpoint only if it can be durable in time
  (trainer/preemption/requests.py estimates it from the state size and the measured bandwidth).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from spotrun.trainer.distributed.ranks import Ranks
from spotrun.trainer.preemption.handover import POLL_S as HANDOVER_POLL_S
from spotrun.trainer.preemption.handover import Handover
from spotrun.trainer.preemption.requests import (
    DEFAULT_UPLOAD_BPS,
    DEFAULT_WRITE_BPS,
    SavePlan,
    StopRequest,
    plan_emergency_save,
)
from spotrun.trainer.storage import Storage
from spotrun.trainer.telemetry.status import StatusReporter

log = logging.getLogger("spotrun.trainer.session.loop")  # the loop's log name, which log readers match


@dataclass(frozen=True)
class SaveCost:
    """What an emergency checkpoint would write and how fast (this rank's share)."""

    nbytes: int
    write_bps: float
    upload_bps: float
    measured: bool

    @classmethod
    def of(cls, bandwidth: tuple[float, float] | None, nbytes: int) -> SaveCost:
        write_bps, upload_bps = bandwidth or (DEFAULT_WRITE_BPS, DEFAULT_UPLOAD_BPS)
        return cls(nbytes, write_bps, upload_bps, bandwidth is not None)


@dataclass
class HandoverOptions:
    handover_s: float = 0.0  # train through a notice for up to this long; 0: stop at the next step
    worker_id: str | None = None  # this trainer's name in the lease, which a standby names
    sigterm_window_s: float = 0.0  # a SIGTERM's warning before SIGKILL, when the provider knows it
    announce_s: float = 0.0  # how long a noticed trainer waits for its replacement's announcement
    save_margin_s: float = 5.0  # the job's preemption.save_margin_s


class HandoverGate:
    """Whether a noticed single process may stop now (the handover state machine)."""

    def __init__(self, stop: StopRequest, opts: HandoverOptions, reporter: StatusReporter) -> None:
        self.stop, self.opts, self.reporter = stop, opts, reporter
        self.handover: Handover | None = None
        self.logged = False
        self.at_count = 0  # stop requests when the handover began

    def may_stop(self, storage: Storage | None, step: int, budget: Callable[[], float]) -> bool:
        """At once without `handover_s` or on Ctrl-C; else once the replacement stands by, the time is
        up, or a second stop request came. `budget`: seconds of training a handover may add."""
        stop, opts = self.stop, self.opts
        if opts.handover_s <= 0 or opts.worker_id is None or stop.reason == "SIGINT":
            return True
        if self.handover is None:
            seconds = budget()
            if seconds <= 0 or stop.count > 1:
                return True
            assert storage is not None
            self.handover = Handover(storage, opts.worker_id, seconds, announce_s=opts.announce_s)
            self.at_count = stop.count
            if stop.deadline is None:  # a signal: the controller learns of the notice from this record
                self.reporter.emit("notice", cloud="signal", action=stop.reason or "", stop=True)
            log.info(
                "notice (%s) at step %d: training on until the replacement stands by (at most %.1f s)",
                stop.reason,
                step,
                seconds,
            )
        if stop.count > self.at_count:  # a cancel, the machine shutting down: no more waiting
            self.handover.end("a second stop request")
        if not self.handover.ready:
            return False
        if not self.logged:
            self.logged = True
            log.info(
                "handing over after %.2f s more training: %s", self.handover.waited_s, self.handover.reason
            )
        return True

    def budget(self, cost: SaveCost, step_s: float) -> float:
        """Seconds of training a handover may add: `handover_s`, less what the emergency checkpoint needs
        before the notice's deadline (with its margin), or before the second half of a SIGTERM's window;
        a SIGTERM with no known window hands over nothing. The reserve assumes a periodic checkpoint in
        flight when the stop comes (two saves), plus a poll and two steps of lateness."""
        stop, opts = self.stop, self.opts
        now = time.time()
        if stop.deadline is not None:
            end, margin = stop.deadline, opts.save_margin_s
        elif stop.reason == "SIGTERM" and opts.sigterm_window_s > 0:
            end, margin = (stop.received_at or now) + opts.sigterm_window_s, opts.sigterm_window_s / 2
        else:
            return 0.0
        save = plan_emergency_save(
            cost.nbytes,
            cost.write_bps,
            cost.upload_bps,
            now=now,
            deadline=end,
            margin_s=margin,
            in_flight=True,
        ).estimate_s
        late = HANDOVER_POLL_S + 2 * step_s
        return min(opts.handover_s, end - now - margin - save - late)


def emergency_plan(
    *, stop: StopRequest, cost: SaveCost, durable: bool, in_flight: bool, margin_s: float, step: int
) -> SavePlan | None:
    """The emergency checkpoint's decision when the stop carries a deadline (None: no deadline, save)."""
    if stop.deadline is None:
        return None
    if durable:
        return SavePlan(True, 0.0, f"step {step} is already durable")
    return plan_emergency_save(
        cost.nbytes,
        cost.write_bps,
        cost.upload_bps,
        now=time.time(),
        deadline=stop.deadline,
        margin_s=margin_s,
        measured=cost.measured,
        in_flight=in_flight,
    )


def agreed_plan(plan: SavePlan | None, ranks: Ranks) -> SavePlan | None:
    """Ranks: a save every rank can finish in time, or none (the slowest decides)."""
    if not ranks.distributed:
        return plan
    mine = plan.save if plan is not None else True
    if ranks.all_true(mine):
        return plan
    why = plan.reason if plan is not None and not mine else "another rank cannot finish it in time"
    return SavePlan(False, plan.estimate_s if plan else 0.0, why)
