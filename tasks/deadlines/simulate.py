"""A job of fixed work run through a policy's decisions against capacity traces, on a virtual clock.

One tick of the traces at a time (the optimum in optimum.py uses the same rules, so the two are
comparable to the cent):

1. a spot worker whose zone has no capacity this tick is reclaimed (with notice: spotrun saves the
   last step, so a reclaim loses no work, only the restart the next start costs);
2. the policy chooses spot, on-demand or wait from the situation it would see in the product;
3. the choice is applied: a start (from nothing, or a switch of market) costs `restart_ticks` ticks of
   paid time without progress; spot starts in the zone with capacity that had the most of it over the
   last day (the past only), on-demand is always there;
4. the tick runs: whatever runs is paid for the tick, and progresses one tick once its restart is over.

Work, deadline and restart are whole ticks: `Job.of` rounds seconds up (work, restart) or down
(deadline), so a job never looks easier than it is.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from spotrun.tasks.deadlines.policy import Decision, Market, Policy, Situation
from spotrun.tasks.market.traces import Trace, best_zone


@dataclass(frozen=True)
class Job:
    """A job on the trace's clock, in ticks, and what a tick of each market costs."""

    work_ticks: int
    deadline_ticks: int
    restart_ticks: int
    spot_per_tick: float
    on_demand_per_tick: float
    gap_s: float

    @classmethod
    def of(
        cls,
        *,
        work_s: float,
        deadline_s: float,
        restart_s: float,
        gap_s: float,
        spot_per_h: float,
        on_demand_per_h: float,
    ) -> Job:
        return cls(
            work_ticks=math.ceil(work_s / gap_s),
            deadline_ticks=math.floor(deadline_s / gap_s),
            restart_ticks=math.ceil(restart_s / gap_s),
            spot_per_tick=spot_per_h * gap_s / 3600,
            on_demand_per_tick=on_demand_per_h * gap_s / 3600,
            gap_s=gap_s,
        )

    @property
    def on_demand_cost(self) -> float:
        """The job run once on on-demand: its restart and its work."""
        return (self.work_ticks + self.restart_ticks) * self.on_demand_per_tick


@dataclass(frozen=True)
class Step:
    """One tick where the market changed: what the policy chose and why."""

    tick: int
    choice: str
    zone: str | None
    reason: str


@dataclass
class Run:
    """How one simulated job went."""

    cost: float = 0.0
    finished_tick: int | None = None
    spot_ticks: int = 0
    on_demand_ticks: int = 0
    preemptions: int = 0
    steps: list[Step] = field(default_factory=list)

    def met(self, job: Job) -> bool:
        return self.finished_tick is not None and self.finished_tick <= job.deadline_ticks


def simulate(
    policy: Policy,
    traces: Sequence[Trace],
    job: Job,
    *,
    start: int = 0,
    limit_factor: float = 3.0,
    keep_spot: bool = False,
) -> Run:
    """Run `job` from tick `start` of `traces` (one zone each, one clock) under `policy`.
    `keep_spot`: the policy is not asked while a spot worker runs, as spotrun's controller asks it (at
    each provisioning, and each poll while on-demand runs: tasks/control/market.py `BackToSpot`); a
    spot worker keeps its market until its reclaim."""
    run = Run()
    g = job.gap_s
    running: Market | None = None
    zone: int | None = None
    overhead = done = 0
    short_since: int | None = None
    last = ""
    limit = max(int(job.deadline_ticks * limit_factor), job.work_ticks * 2 + 10)
    for tick in range(limit):
        caps = [t.at(start + tick) > 0 for t in traces]
        if running == "spot" and zone is not None and not caps[zone]:
            running, zone, overhead = None, None, 0
            run.preemptions += 1
        available = any(caps)
        if available:
            short_since = None
        elif short_since is None:
            short_since = tick
        situation = Situation(
            now_s=tick * g,
            deadline_s=job.deadline_ticks * g,
            work_s=job.work_ticks * g,
            done_s=done * g,
            restart_s=job.restart_ticks * g,
            running=running,
            spot_available=available,
            preemptions=run.preemptions,
            spot_short_s=0.0 if short_since is None else (tick - short_since) * g,
        )
        if keep_spot and running == "spot":
            decision: Decision = Decision("spot", "running")
        else:
            decision = policy(situation)
        choice = decision.choice
        if choice == "spot" and not available:
            choice = "wait"
        if choice == "wait":
            running, zone, overhead = None, None, 0
        elif choice == "on-demand" and running != "on-demand":
            running, zone, overhead = "on-demand", None, job.restart_ticks
        elif choice == "spot" and running != "spot":
            zone = best_zone(traces, start + tick, caps)
            running, overhead = "spot", job.restart_ticks
        key = f"{choice}:{zone}"
        if key != last:
            name = traces[zone].zone if zone is not None else None
            run.steps.append(Step(tick, choice, name, decision.reason))
            last = key
        if running is None:
            continue
        if running == "spot":
            run.cost += job.spot_per_tick
            run.spot_ticks += 1
        else:
            run.cost += job.on_demand_per_tick
            run.on_demand_ticks += 1
        if overhead > 0:
            overhead -= 1
        else:
            done += 1
            if done >= job.work_ticks:
                run.finished_tick = tick + 1
                return run
    return run
