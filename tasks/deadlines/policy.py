"""Spot, on-demand or wait: the market for the next stretch of a job that has a deadline.

Each provisioning decision (and each tick of a trace replay) asks `choose(policy, situation)`; the
answer names the market and says why in one line, which goes to the attempt's row and events. The
policies, all pure:

    on-demand          always on-demand: the cost every saving is measured against
    greedy             spot while there is any, wait for it while the slack lasts, then on-demand to
                       the end (it spends all its slack early and never comes back to spot)
    uniform-progress   the published policy (Wu et al., *Can't Be Late*, NSDI '24): keep progress on
                       the straight line from start to deadline; spot whenever there is some, and when
                       there is none, on-demand only if behind the line; off on-demand only once ahead
                       of it by two restart overheads (hysteresis); a safety net of two restart
                       overheads before the deadline, after which it stays on on-demand
    spotrun            greedy with a reserve: spot whenever there is some, and an outage waited out
                       while the slack exceeds RESERVE_RESTARTS restarts; then on-demand, but not to
                       the end: back to spot as soon as there is some and the slack still holds the
                       two restarts that costs (the start on spot, and the start on on-demand a
                       later outage may need). The deadline holds as in greedy: the slack never
                       goes below the one restart an on-demand start costs. On the AWS V100 traces
                       (bench/deadline.py, docs/benchmarks.md) it costs less than uniform progress
                       and greedy on average; what it gives away to the optimum is reported there
    fixed              spotrun's rule before deadlines: on-demand after N preemptions or after S
                       seconds without spot capacity (the provider's on_demand_after_* settings)

Times are seconds: `now_s` since the job's start (its submission, or its schedule slot), the deadline
likewise; `work_s` is the compute the job needs on one worker at its measured step rate, `done_s` the
durable part of it; `restart_s` the measured cost of a start (provision, restore, warm-up), from the
job's own history in SQL.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from spotrun.tasks.market.fallback import FixedRule
from spotrun.tasks.providers.base import Market

Choice = Literal["spot", "on-demand", "wait"]


@dataclass(frozen=True)
class Situation:
    """What a decision knows: the job's progress, its clock, and the market now."""

    now_s: float
    deadline_s: float
    work_s: float
    done_s: float
    restart_s: float
    running: Market | None  # what runs now (None: nothing; a reclaimed spot worker is nothing)
    spot_available: bool  # spot capacity in some allowed zone now, as far as known
    preemptions: int = 0  # spot reclaims so far (the fixed policy's count)
    spot_short_s: float = 0.0  # how long spot has been unavailable, from the last failure (max_wait_s)

    @property
    def remaining_s(self) -> float:
        return max(self.work_s - self.done_s, 0.0)

    @property
    def left_s(self) -> float:
        return self.deadline_s - self.now_s

    @property
    def slack_s(self) -> float:
        """Time that may still pass without progress: left minus the work still to do and, when nothing
        runs on-demand now, the restart that starting it would cost."""
        start = 0.0 if self.running == "on-demand" else self.restart_s
        return self.left_s - self.remaining_s - start


@dataclass(frozen=True)
class Decision:
    choice: Choice
    reason: str  # one line


def on_demand(s: Situation) -> Decision:
    return Decision("on-demand", "policy on-demand")


def greedy(s: Situation) -> Decision:
    if s.running == "on-demand" or s.slack_s <= 0:
        return Decision("on-demand", f"slack {s.slack_s:.0f} s spent: on-demand to the end")
    if s.spot_available:
        return Decision("spot", f"spot available, slack {s.slack_s:.0f} s")
    return Decision("wait", f"no spot; waiting on slack {s.slack_s:.0f} s")


def _line(s: Situation, end_s: float) -> float:
    """Where uniform progress to `end_s` puts the job now."""
    return s.work_s * min(max(s.now_s, 0.0) / end_s, 1.0) if end_s > 0 else s.work_s


def uniform_progress(s: Situation) -> Decision:
    d = s.restart_s
    if s.left_s < s.remaining_s + 2 * d:
        return Decision("on-demand", f"safety net: {s.left_s:.0f} s left for {s.remaining_s:.0f} s of work")
    ahead = s.done_s - _line(s, s.deadline_s)
    if s.running == "on-demand":
        if s.spot_available and ahead >= 2 * d:
            return Decision("spot", f"ahead of the line by {ahead:.0f} s (>= 2 restarts): back to spot")
        return Decision("on-demand", f"on-demand until ahead by 2 restarts (now {ahead:.0f} s)")
    if s.spot_available:
        return Decision("spot", f"spot available ({ahead:+.0f} s against the line)")
    if ahead < 0:
        return Decision("on-demand", f"no spot and behind the line by {-ahead:.0f} s")
    return Decision("wait", f"no spot; ahead of the line by {ahead:.0f} s")


RESERVE_RESTARTS = 4  # an outage is waited out while the slack exceeds this many restarts
BACK_RESTARTS = 2  # on-demand returns to spot while the slack holds this many restarts


def spotrun(s: Situation) -> Decision:
    d = s.restart_s
    if s.running == "on-demand":
        if s.spot_available and s.slack_s >= BACK_RESTARTS * d:
            return Decision("spot", f"spot is back and the slack {s.slack_s:.0f} s holds 2 restarts")
        return Decision("on-demand", f"on-demand (slack {s.slack_s:.0f} s)")
    if s.slack_s <= 0:
        return Decision("on-demand", f"no slack left ({s.slack_s:.0f} s): on-demand")
    if s.spot_available:
        return Decision("spot", f"spot available, slack {s.slack_s:.0f} s")
    if s.slack_s > RESERVE_RESTARTS * d:
        return Decision("wait", f"no spot; waiting on slack {s.slack_s:.0f} s")
    return Decision("on-demand", f"no spot and the slack {s.slack_s:.0f} s is down to the reserve")


def fixed(rule: FixedRule) -> Callable[[Situation], Decision]:
    """The provider's on_demand_after_preemptions / on_demand_after_s rules, as a policy."""

    def decide(s: Situation) -> Decision:
        if s.running == "on-demand":
            return Decision("on-demand", "on-demand stays (the fixed rules are sticky)")
        short = None if s.spot_available else s.spot_short_s
        reason = rule.on_demand_reason(preemptions=s.preemptions, short_s=short)
        if reason is not None:
            return Decision("on-demand", reason)
        if s.spot_available:
            return Decision("spot", "spot available")
        return Decision("wait", "no spot yet")

    return decide


Policy = Callable[[Situation], Decision]
POLICIES: dict[str, Policy] = {
    "on-demand": on_demand,
    "greedy": greedy,
    "uniform-progress": uniform_progress,
    "spotrun": spotrun,
}
