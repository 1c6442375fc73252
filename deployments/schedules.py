"""The scheduled training deployments of prefect.yaml and how far apart their slots are (pure).

The missed-run alert (deployments/automations.py) gives each scheduled training run until a deadline
after its slot; by default the next slot, so it needs each schedule's period. A cron schedule's period is
the most common gap between its slots over a fixed span of a year in its own timezone (a nightly cron:
24 h, whatever the DST days; weekdays only: 24 h, so Friday's run is due by Saturday's slot time, not
Monday's). An interval schedule's is its interval. RRule schedules have none here: set the deadline
(`AlertRules.missed_run_after_s`) for them.
"""

from __future__ import annotations

import itertools
from collections import Counter
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any
from zoneinfo import ZoneInfo

# Prefect's own cron parser (vendored; the same one its scheduler uses): croniter is not installed
# separately. tests/unit/test_deployments.py pins the name.
from prefect._vendor.croniter import croniter

from spotrun.trainer.spec.deadline import duration_s

TRAINING_ENTRYPOINT = ":resilient_training"
REFERENCE = datetime(2026, 1, 1)  # fixed, so a redeploy computes the same period (an update resets buckets)
SLOTS_SAMPLED = 400


@dataclass(frozen=True)
class ScheduledTraining:
    """A training deployment with a schedule: its name, its default job's name, its slots' period."""

    deployment: str
    job: str  # the job its default parameters train (the alert's job when the run's own is unknown)
    period_s: float | None  # None: a schedule whose period is not known here (rrule)
    deadline_s: float | None = None  # the default job's `deadline` when it is a duration (from the slot)


def period_s(schedule: dict[str, Any]) -> float | None:
    """The usual gap between a prefect.yaml schedule's slots, in seconds (None: rrule or unknown)."""
    interval = schedule.get("interval")
    if interval is not None:
        return interval.total_seconds() if isinstance(interval, timedelta) else float(interval)
    cron = schedule.get("cron")
    if not cron:
        return None
    zone = ZoneInfo(schedule.get("timezone") or "UTC")
    it = croniter(cron, REFERENCE.replace(tzinfo=zone), day_or=schedule.get("day_or", True))
    slots = [it.get_next(datetime) for _ in range(SLOTS_SAMPLED)]
    gaps = Counter((b - a).total_seconds() for a, b in itertools.pairwise(slots))
    top = max(gaps.values())
    return min(g for g, n in gaps.items() if n == top)  # a tie: the shorter gap, the earlier alert


def scheduled_training(doc: dict[str, Any]) -> list[ScheduledTraining]:
    """prefect.yaml's training deployments that have schedules (active or not: a paused schedule makes no
    runs, and so no alerts)."""
    out = []
    for d in doc.get("deployments") or []:
        schedules = d.get("schedules") or []
        if not str(d.get("entrypoint", "")).endswith(TRAINING_ENTRYPOINT) or not schedules:
            continue
        periods = [p for p in (period_s(s) for s in schedules) if p is not None]
        spec = (d.get("parameters") or {}).get("job") or {}
        job = spec.get("name") or d["name"]
        due = duration_s(str(spec["deadline"])) if spec.get("deadline") else None
        out.append(ScheduledTraining(d["name"], str(job), min(periods) if periods else None, due))
    return out
