"""Lost steps, by one rule: the attempts table, the adopted attempt and the goodput report all ask here.

An attempt keeps its work up to one step and loses the rest:

    completed        kept = its last step: nothing lost
    otherwise        kept = where the next attempt resumed, when that is known; else its newest durable
                            step (its start step when it reported none); bounded to [start, last step]
    lost = last step - kept, never below 0

The next attempt's resume point decides when known: below the durable step, the trainer passed over a
newer checkpoint and that work was redone; above it, this attempt wrote a checkpoint it did not live to
report. The bounds keep an attempt from losing steps it never took (a next attempt that resumed from
before this one's start, or from scratch) or keeping steps past the last it reported.

"Known" is the trainer's `started` record once the next attempt has one (the goodput report, computed
from SQL), or the flow's estimate between two attempts (the integrity check's resume point, made after
this attempt ended: JobRunLog.record); unknown (None) for the last attempt of a run that ended, a
cancelled one, one whose controller died, or when the integrity check could not run.
"""

from __future__ import annotations

from collections.abc import Sequence

from spotrun.tasks.decisions.attempts import AttemptRecord, Outcome


def kept_step(
    last_step: int,
    *,
    start: int = 0,
    durable: int | None = None,
    next_start: int | None = None,
    completed: bool = False,
) -> int:
    """The newest step of an attempt's work that training goes on from (the rule in the docstring)."""
    if completed:
        return last_step
    keep = next_start if next_start is not None else durable if durable is not None else start
    return max(start, min(keep, last_step))


def lost_steps(last_step: int, kept: int) -> int:
    """Steps an attempt reached past the one kept (`kept_step`): the next attempt redoes them."""
    return max(0, last_step - kept)


def trained_at(record: AttemptRecord) -> float | None:
    """When its `started` record arrived (after the restore, before the first step), if stored."""
    t = record.extra.get("started_training_at")
    return float(t) if isinstance(t, int | float) else None


def known_start(record: AttemptRecord) -> int | None:
    """The step it resumed from, when it said so: `resumed_from`, or scratch when its `started` record
    came without one. None for an attempt that never sent one (a provision failure, a lost worker)."""
    if record.resumed_from is not None:
        return record.resumed_from
    return 0 if trained_at(record) is not None else None


def walk(rows: Sequence[AttemptRecord], next_start: int | None = None) -> tuple[list[int], list[int]]:
    """Each attempt's start step and kept step, oldest first. `next_start`: where the attempt after
    the last row resumes, when known. An attempt that never said where it started is assumed to have
    resumed where the previous one's kept work ended."""
    starts: list[int] = []
    kept: list[int] = []
    for i, r in enumerate(rows):
        known = known_start(r)
        start = known if known is not None else (kept[-1] if kept else 0)
        later = (known_start(n) for n in rows[i + 1 :] if n.outcome is not Outcome.PROVISION_FAILED)
        nxt = next(later, next_start)
        starts.append(start)
        done = r.outcome is Outcome.COMPLETED
        kept.append(
            kept_step(r.last_step, start=start, durable=r.last_durable_step, next_start=nxt, completed=done)
        )
    return starts, kept
