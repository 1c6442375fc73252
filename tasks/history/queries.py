"""The history's reads: the queries behind HistoryStore that return rows, oldest first."""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime
from typing import TypeVar

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from spotrun.tasks.decisions.attempts import Outcome
from spotrun.tasks.history.models import (
    Alert,
    AlertRow,
    Attempt,
    AttemptRow,
    CheckpointRejection,
    JobRun,
    JobRunRow,
    JobStatus,
    RejectionRow,
    alert_row,
    attempt_row,
    job_run_row,
    rejection_row,
)

_T = TypeVar("_T")


class HistoryReads:
    """The read half of HistoryStore, which supplies `_read` (a query in a session, or StoreUnavailable)."""

    def _read(self, query: Callable[[Session], _T]) -> _T:
        raise NotImplementedError

    def attempts(
        self,
        job: str | None = None,
        job_run_id: str | None = None,
        limit: int = 200,
        run_key: str | None = None,
    ) -> list[AttemptRow]:
        """The newest `limit` attempts (of a job, a job run, or one run key's job runs), oldest first."""
        q = select(Attempt)
        if run_key is not None:
            q = q.join(JobRun, JobRun.id == Attempt.job_run_id).where(JobRun.run_key == run_key)
        if job is not None:
            q = q.where(Attempt.job == job)
        if job_run_id is not None:
            q = q.where(Attempt.job_run_id == job_run_id)
        q = q.order_by(Attempt.started_at.desc(), Attempt.attempt.desc(), Attempt.id.desc()).limit(limit)
        return [attempt_row(a) for a in reversed(self._read(lambda s: list(s.scalars(q))))]

    def job_runs(
        self,
        job: str | None = None,
        limit: int = 50,
        run_key: str | None = None,
        *,
        id_prefix: str | None = None,
    ) -> list[JobRunRow]:
        """The newest `limit` job runs (of a job, of one run key, whose id begins `id_prefix`), oldest
        first."""
        q = select(JobRun)
        if job is not None:
            q = q.where(JobRun.job == job)
        if run_key is not None:
            q = q.where(JobRun.run_key == run_key)
        if id_prefix is not None:
            q = q.where(JobRun.id.startswith(id_prefix, autoescape=True))
        q = q.order_by(JobRun.started_at.desc(), JobRun.id.desc()).limit(limit)
        return [job_run_row(r) for r in reversed(self._read(lambda s: list(s.scalars(q))))]

    def latest_job_run(self, job: str, run_key: str | None = None) -> JobRunRow | None:
        """The job's (or its run key's) most recently started job run, if any."""
        runs = self.job_runs(job, limit=1, run_key=run_key)
        return runs[-1] if runs else None

    def job_run(self, job_run_id: str) -> JobRunRow | None:
        """One job run by its id."""
        found = self._read(lambda s: s.get(JobRun, job_run_id))
        return job_run_row(found) if found is not None else None

    def job_run_of_flow_run(self, flow_run_id: str) -> JobRunRow | None:
        """The job run a flow run holds or held last (a crashed one's, for recover-job's rerun)."""
        q = select(JobRun).where(JobRun.flow_run_id == flow_run_id).order_by(JobRun.started_at.desc())
        found = self._read(lambda s: s.scalars(q).first())
        return job_run_row(found) if found is not None else None

    def open_job_run(self, job: str) -> JobRunRow | None:
        """The job's newest job run when it is still running (its controller died); else None."""
        latest = self.latest_job_run(job)
        return latest if latest is not None and latest.status is JobStatus.RUNNING else None

    def next_attempt(self, job_run_id: str) -> int:
        """The number the job run's next attempt takes: one past the highest recorded (1 if none)."""
        q = select(func.max(Attempt.attempt)).where(Attempt.job_run_id == job_run_id)
        return int(self._read(lambda s: s.scalar(q)) or 0) + 1

    def alerts(
        self,
        job: str | None = None,
        kind: str | None = None,
        since: datetime | None = None,
        limit: int = 100,
    ) -> list[AlertRow]:
        """The newest `limit` alerts (of a job, of a kind, created at or after `since`), oldest first."""
        q = select(Alert)
        if job is not None:
            q = q.where(Alert.job == job)
        if kind is not None:
            q = q.where(Alert.kind == str(kind))
        if since is not None:
            if since.tzinfo is None:
                raise ValueError(f"since={since!r} is naive: pass an aware datetime, e.g. datetime.now(UTC)")
            q = q.where(Alert.created_at >= since)
        q = q.order_by(Alert.created_at.desc(), Alert.id.desc()).limit(limit)
        return [alert_row(a) for a in reversed(self._read(lambda s: list(s.scalars(q))))]

    def rejections(self, job_run_id: str) -> list[RejectionRow]:
        """The checkpoints refused during a job run, in the order they were recorded."""
        q = (
            select(CheckpointRejection)
            .where(CheckpointRejection.job_run_id == job_run_id)
            .order_by(CheckpointRejection.attempt, CheckpointRejection.id)
        )
        return [rejection_row(r) for r in self._read(lambda s: list(s.scalars(q)))]

    def restarts_within(self, job: str, since: datetime) -> list[AttemptRow]:
        """Attempts of `job` that ended at or after `since` without completing, oldest first."""
        if since.tzinfo is None:
            raise ValueError(f"since={since!r} is naive: pass an aware datetime, e.g. datetime.now(UTC)")
        q = (
            select(Attempt)
            .where(Attempt.job == job, Attempt.ended_at >= since, Attempt.outcome != Outcome.COMPLETED.value)
            .order_by(Attempt.ended_at, Attempt.id)
        )
        return [attempt_row(a) for a in self._read(lambda s: list(s.scalars(q)))]
