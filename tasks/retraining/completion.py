"""What follows a completed run of a keyed (or gated) job: the promotion decision recorded, announced and
summarised, then retention across the job's runs.

The tracker decides and moves the MLflow alias when the job is tracked (TrackingInfo.promotion); without
MLflow the same decision is read from COMPLETED.json here (tasks/decisions/promotion.py). Either way SQL keeps
it on the job run (`promotion`), which `init_from: {which: best}` and the next champion read back, and an
event carries it to the promotion alert. Retention runs last, so that a run the alias just moved to is
protected as the champion.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any, Protocol

from spotrun.tasks.decisions.promotion import event_payload, promotion_for
from spotrun.tasks.history.models import JobRunRow, JobStatus
from spotrun.tasks.reports import reporting as report
from spotrun.tasks.retraining.run_keys import MAX_RUNS_READ, pick_source
from spotrun.tasks.retraining.run_retention import RunRecord, lineage_keys, prune_runs
from spotrun.trainer.spec.job import JobSpec
from spotrun.trainer.spec.runs import BEST


class Store(Protocol):
    def annotate_job_run(self, job_run_id: str, field: str, value: dict[str, Any]) -> None: ...

    def job_runs(
        self, job: str | None = None, limit: int = 50, run_key: str | None = None
    ) -> list[JobRunRow]: ...


class Sink(Protocol):
    def log(self, level: int, msg: str) -> None: ...

    def event(
        self, name: str, job: str, payload: dict[str, Any], labels: dict[str, str] | None = None
    ) -> None: ...


def after_completion(
    job: JobSpec,
    store: Store,
    sink: Sink,
    *,
    job_run_id: str,
    flow_run_id: str,
    tracked: dict[str, Any] | None,
) -> dict[str, Any] | None:
    """Record and announce the promotion decision (`tracked`: the tracker's, None to decide here), then
    prune older run keys. Returns the decision (None: the job has no promotion gate). Never raises for
    housekeeping: a completed run stays completed."""
    decision = tracked
    if decision is None and job.promote is not None:
        made = promotion_for(job)
        decision = made.as_dict() if made is not None else None
    if decision is not None:
        sink.log(logging.INFO, f"promotion: {decision['reason']}")
        try:
            store.annotate_job_run(job_run_id, "promotion", decision)
        except Exception as e:  # the event and the summary still say it; SQL gets it when it answers
            sink.log(logging.WARNING, f"promotion not recorded in SQL: {e}")
        payload, labels = _payload(decision, job, job_run_id, flow_run_id)
        sink.event(report.MODEL_PROMOTION, job.name, payload, labels)
    if job.keep_runs is not None:
        _retain(job, store, sink, job_run_id=job_run_id, decision=decision)
    return decision


def _payload(
    decision: dict[str, Any], job: JobSpec, job_run_id: str, flow_run_id: str
) -> tuple[dict[str, Any], dict[str, str]]:
    from spotrun.tasks.decisions.promotion import PromotionDecision

    made = PromotionDecision(**decision)
    return event_payload(made, run_key=job.run_key, job_run_id=job_run_id, flow_run_id=flow_run_id)


def _retain(
    job: JobSpec, store: Store, sink: Sink, *, job_run_id: str, decision: dict[str, Any] | None
) -> None:
    try:
        rows = store.job_runs(job.name, limit=MAX_RUNS_READ)
    except Exception as e:  # a database that is down: the next completed night prunes
        sink.log(logging.WARNING, f"retention skipped: the job's runs could not be read ({e})")
        return
    in_flight, protected = keys_in_use(job, rows, job_run_id, decision)
    # runs_to_prune ranks a key by the job run that completed it: each row as it is
    records = [
        RunRecord(
            r.job, r.run_key, r.storage_uri, status=r.status.value, started_at=r.started_at, job_run_id=r.id
        )
        for r in rows
    ]
    done = prune_runs(job, records, in_flight=in_flight, protected=protected)
    sink.log(logging.WARNING if done.errors else logging.INFO, done.line())


def keys_in_use(
    job: JobSpec, rows: Sequence[JobRunRow], job_run_id: str, decision: dict[str, Any] | None
) -> tuple[set[str], set[str]]:
    """(keys in flight, keys protected): running keys, and what they and the champion read. The champion
    is this run's key when it just took the alias, else the newest promoted run."""
    running = [r for r in rows if r.status is JobStatus.RUNNING and r.id != job_run_id]
    in_flight = {r.run_key for r in running if r.run_key}
    protected = set().union(*(lineage_keys(job.name, r.lineage) for r in running))
    champion = job.run_key if decision and decision.get("promoted") else None
    if champion is None and (held := pick_source(rows, BEST, job.run_key)) is not None:
        champion = held.run_key
    return in_flight, protected | ({champion} if champion else set())
