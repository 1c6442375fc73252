"""What the next trainer is told beyond the job file, from this job's history in SQL.

Two things: with `checkpoint.every: auto`, how often this job's workers are reclaimed on this provider
(tasks/decisions/mtbf.py), which the trainer's interval tuner plans its checkpoint interval for; and
after a rollback, the data to skip at a resume from the checkpoint gone back to (tasks/control/rollback.py),
read from the job run's rows, so a controller that adopts the run after a crash passes it on too.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Protocol

from spotrun.tasks.control.rollback import ROLLBACK
from spotrun.tasks.decisions.attempts import AttemptRecord
from spotrun.tasks.decisions.mtbf import estimate_mtbf
from spotrun.tasks.history import StoreUnavailable
from spotrun.tasks.history.models import AttemptRow
from spotrun.trainer.spec.job import JobSpec


class Store(Protocol):
    def attempts(self, job: str | None = None) -> list[AttemptRow]: ...


class Sink(Protocol):
    def log(self, level: int, msg: str) -> None: ...


def trainer_args(
    job: JobSpec, store: Store, provider: str, *, sink: Sink, reclaimed_after_s: float | None = None
) -> list[str]:
    """The arguments; `reclaimed_after_s`: the attempt in flight is being reclaimed (a replacement
    started at its notice), after this long: it counts too."""
    if job.checkpoint.every != "auto":
        return []
    try:
        rows = store.attempts(job=job.name)
    except StoreUnavailable as e:  # a database that is down never stops training: the prior then
        sink.log(logging.WARNING, f"no attempt history for the checkpoint interval: {e}")
        rows = []
    est = estimate_mtbf(rows, provider, job.checkpoint.mtbf_prior_s, reclaimed_after_s=reclaimed_after_s)
    sink.log(logging.INFO, f"checkpoint interval planned for {est.describe()}")
    return ["--mtbf-s", f"{est.mtbf_s:.0f}"]


def skip_args(records: Sequence[AttemptRecord]) -> list[str]:
    """`--skip-steps N@STEP` for every rollback of the job run that skips data (rows oldest first)."""
    out: list[str] = []
    for r in records:
        rb = r.extra.get(ROLLBACK)
        if isinstance(rb, dict) and rb.get("skip_steps"):
            out += ["--skip-steps", f"{int(rb['skip_steps'])}@{int(rb.get('to_step') or 0)}"]
    return out
