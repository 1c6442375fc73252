"""Metrics objects that MLflow already holds, deleted from the job's storage: what stays is what is still
to be sent, or still to be read by a resume check.

Every checkpoint adds one object under `metrics/` (trainer/telemetry/metrics_log.py). Never deleted, a job
of 10,000 checkpoints kept 10,000 of them, and the tracker's listing of `metrics/` every POLL_S grew with
the job: one S3 LIST request per 1,000 objects (10,000 keys: 10 pages, ~1 s against moto on this VM, half
of it botocore parsing each key's date). So once MLflow has every step an object holds (its durable step
at or below the run's high-water mark `spotrun.metrics_through`), the object goes, unless a resume check
(tasks/tracking/fidelity.py) may still read it:

- the newest committed checkpoint's object and those within TREND_WINDOW steps before it: the next
  attempt resumes there, and its notice check reads the rate the scheduler set after that step
  (`lr_next`, on the object's last line) and the loss trend before it;
- for an attempt still running, the objects from TREND_WINDOW steps before its resume point through the
  first that covers the step after the lost attempt's last (its own first step after a notice): its
  check, made when it ends, compares those.

With `tracking.mlflow` off nothing is sent, so nothing is deleted here.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from spotrun.tasks.tracking.fidelity import TREND_WINDOW
from spotrun.trainer.storage import Storage

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Hold:
    """Steps a resume check still to be made reads: (start - TREND_WINDOW, through], so the objects from
    the first past start - TREND_WINDOW to the one covering `through`. `through` None: everything after
    the start (the lost attempt's last step is not known yet)."""

    start: int
    through: int | None


def collectable(durables: Iterable[int], *, sent_through: int, holds: Sequence[Hold]) -> list[int]:
    """The durable steps of the metrics objects that may be deleted: sent whole, and held by no check."""
    ds = sorted(set(durables))
    kept: set[int] = set()
    for h in holds:
        last = next((d for d in ds if d >= h.through), None) if h.through is not None else None
        kept.update(d for d in ds if d > h.start - TREND_WINDOW and (last is None or d <= last))
    return [d for d in ds if d <= sent_through and d not in kept]


def collect(
    storage: Storage, objects: Sequence[tuple[int, str]], *, sent_through: int, holds: Sequence[Hold]
) -> list[str]:
    """Delete the collectable ones of `objects` ((durable step, key), as listed); return their keys."""
    doomed = set(collectable((d for d, _ in objects), sent_through=sent_through, holds=holds))
    keys = [k for d, k in objects if d in doomed]
    if keys:
        storage.delete(keys)
        log.debug("deleted %d metrics object(s) MLflow holds, through step %d", len(keys), max(doomed))
    return keys
