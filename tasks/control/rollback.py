"""A rollback after a loss spike: quarantine the checkpoints taken since, and have the next trainer skip
the data that may have caused it (the rule: tasks/decisions/anomaly.py).

The attempt that spiked was killed by the watchdog (tasks/control/watchdog.py), so no checkpoint of it
can still become durable. Every committed checkpoint newer than the last good loss sample is taken out of
the timeline by the same quarantine a damaged one gets (trainer/checkpoint/catalog.py: its manifest moves
into REJECTED.json, the evidence stays until retention), so the next trainer's own choice of the newest
valid checkpoint is the one before the spike. The skip travels as `--skip-steps N@STEP` (the data of N
steps after resuming from STEP): it applies only to a resume from exactly that step, so an attempt that
dies before its first checkpoint after the skip is followed by one that skips again, and one that
resumes from a later checkpoint (which holds the skipped data position) skips nothing. The job run keeps
every rollback's skip for its later attempts; the attempt row has `extra.rollback`.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass
from typing import Any, Protocol

from spotrun.tasks.decisions.anomaly import quarantined_by, rollback_target, skip_steps
from spotrun.tasks.decisions.attempts import AttemptRecord
from spotrun.trainer.checkpoint.catalog import Catalog
from spotrun.trainer.spec.job import JobSpec

ROLLBACK = "rollback"  # the attempt extra's key


class LogSink(Protocol):
    def log(self, level: int, msg: str) -> None: ...


@dataclass(frozen=True)
class Rollback:
    """What a rollback did: where the job goes back to, what it quarantined, what data it skips."""

    to_step: int | None  # None: scratch
    first_bad_step: int
    last_good_step: int
    quarantined: tuple[int, ...]
    skip_steps: int  # 0: the data is replayed (loss_spike.skip: false)

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "quarantined": list(self.quarantined)}


def roll_back(job: JobSpec, record: AttemptRecord, sink: LogSink) -> Rollback:
    """Quarantine what the spike made, put the rollback in the attempt's row, and return it."""
    fired = record.extra["watchdog"]["fired"]
    first_bad, last_good = int(fired["first_bad_step"]), int(fired["last_good_step"])
    catalog = Catalog(job.open_storage())
    committed = [step for step, entry in catalog.list().items() if entry.committed]
    target = rollback_target(committed, last_good)
    newer = quarantined_by(committed, target)
    for step in newer:
        catalog.quarantine(step, f"rolled back: a loss spike from step {first_bad}")
    rule = job.watchdog.loss_spike
    skip = skip_steps(target, first_bad) if rule is not None and rule.skip else 0
    done = Rollback(
        to_step=target,
        first_bad_step=first_bad,
        last_good_step=last_good,
        quarantined=tuple(newer),
        skip_steps=skip,
    )
    record.extra[ROLLBACK] = done.as_dict()
    where = f"step {target}" if target is not None else "scratch"
    skipped = f", skipping the data of steps {(target or 0) + 1}-{first_bad}" if skip else ""
    sink.log(
        logging.WARNING,
        f"rolled back to {where} ({len(newer)} newer checkpoint(s) quarantined{skipped})",
    )
    return done
