"""A job's deadline and budget against what its history measured: the check at submission and the
situation each market decision sees (tasks/deadlines/policy.py).

What is measured, from the job's attempts in SQL (every job run of the job, newest first):
- seconds per step: the attempts' productive time over the steps they made durable, pooled; before any
  history, the job file's `seconds_per_step`; without either, no check at submission (a warning) and
  the policy waits for the first attempt to measure it;
- a start's cost: the median of provision → first trained step (`extra.started_training_at`); before
  any, DEFAULT_RESTART_S.

At submission a job is refused, in one line with the numbers, when even on-demand from now cannot make
the deadline (the steps left at the measured rate plus one start), or when the budget cannot pay for
the steps left even all on spot. A budget that covers spot but not on-demand is a warning: the deadline
may need on-demand.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from spotrun.tasks.deadlines.policy import Market, Situation
from spotrun.tasks.decisions.attempts import AttemptRecord
from spotrun.tasks.market.prices import Prices
from spotrun.trainer.spec.deadline import deadline_at
from spotrun.trainer.spec.job import JobSpec

DEFAULT_RESTART_S = 120.0  # a start's cost until the job's history measures one (a local worker: ~10 s)


@dataclass(frozen=True)
class Measured:
    step_s: float | None  # seconds per step on one worker
    step_from: str  # "history", "declared" or "" (unknown)
    restart_s: float
    restart_from: str  # "history" or "assumed"


def measure(job: JobSpec, history: Sequence[AttemptRecord]) -> Measured:
    """Seconds per step and a start's cost from the job's attempts (any job run), else the job file."""
    steps = secs = 0.0
    starts: list[float] = []
    for r in history:
        made = (r.last_durable_step or 0) - (r.resumed_from or 0)
        if made > 0 and r.productive_s > 0:
            steps += made
            secs += r.productive_s
        trained = r.extra.get("started_training_at")
        if isinstance(trained, int | float) and trained >= r.started_at:
            starts.append(trained - r.started_at)
    if steps > 0:
        step_s, step_from = secs / steps, "history"
    elif job.seconds_per_step is not None:
        step_s, step_from = job.seconds_per_step, "declared"
    else:
        step_s, step_from = None, ""
    if starts:
        return Measured(step_s, step_from, restart_s=statistics.median(starts), restart_from="history")
    return Measured(step_s, step_from, restart_s=DEFAULT_RESTART_S, restart_from="assumed")


def _hours(seconds: float) -> str:
    return f"{seconds / 3600:.2f} h"


def submission_problem(
    job: JobSpec, *, now: float, start: float, done_step: int, measured: Measured, prices: Prices | None
) -> tuple[str | None, str | None]:
    """(why the job is refused, a warning): each one line, or None."""
    if job.deadline is None and job.budget_usd is None:
        return None, None
    if measured.step_s is None:
        return None, (
            "no step rate known for the deadline and budget checks (no history, no seconds_per_step); "
            "they run once the first attempt measured it"
        )
    left_steps = max(job.total_steps - done_step, 0)
    work_s = left_steps * measured.step_s + measured.restart_s
    rate = f"{measured.step_s:.3g} s/step ({measured.step_from})"
    if job.deadline is not None:
        due = deadline_at(job.deadline, start)
        if work_s > due - now:
            return (
                f"deadline {job.deadline} is {_hours(max(due - now, 0))} away, but the {left_steps} steps "
                f"left take {_hours(work_s)} even on on-demand ({rate}, plus a {measured.restart_s:.0f} s "
                "start); give a later deadline or fewer total_steps",
                None,
            )
    if job.budget_usd is None or prices is None:
        return None, None
    spot, on_demand = work_s / 3600 * prices.spot_per_h, work_s / 3600 * prices.on_demand_per_h
    if spot > job.budget_usd:
        return (
            f"budget_usd {job.budget_usd:g} cannot pay for the {left_steps} steps left: {_hours(work_s)} "
            f"costs ${spot:.2f} even all on spot (${prices.spot_per_h:g}/h; {rate}); raise the budget",
            None,
        )
    if on_demand > job.budget_usd:
        return None, (
            f"budget_usd {job.budget_usd:g} covers the work on spot (${spot:.2f}) but not on on-demand "
            f"(${on_demand:.2f}): if the deadline needs on-demand, the budget runs out first"
        )
    return None, None


def situation(
    job: JobSpec,
    *,
    now: float,
    start: float,
    done_step: int,
    measured: Measured,
    running: Market | None,
    spot_available: bool,
    preemptions: int,
    spot_short_s: float,
) -> Situation | None:
    """What the market policy sees now (None without a deadline or a step rate: spot, as before)."""
    if job.deadline is None or measured.step_s is None:
        return None
    return Situation(
        now_s=now - start,
        deadline_s=deadline_at(job.deadline, start) - start,
        work_s=job.total_steps * measured.step_s,
        done_s=done_step * measured.step_s,
        restart_s=measured.restart_s,
        running=running,
        spot_available=spot_available,
        preemptions=preemptions,
        spot_short_s=spot_short_s,
    )
