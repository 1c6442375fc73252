"""The restart-history schema (job runs, append-only attempts, checkpoint rejections, alerts) and its rows.

Migrations (`migrations/versions/`) create exactly these tables; a test compares the two.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from datetime import UTC, datetime
from enum import StrEnum
from typing import Any

from sqlalchemy import (
    JSON,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    String,
    Text,
    UniqueConstraint,
    text,
)
from sqlalchemy.engine import Dialect
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column
from sqlalchemy.types import TypeDecorator

from spotrun.tasks.decisions.attempts import AttemptRecord, Outcome

NAMING_CONVENTION = {
    "ix": "ix_%(table_name)s_%(column_0_N_name)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


class JobStatus(StrEnum):
    RUNNING = "running"
    COMPLETED = "completed"
    FAILED = "failed"
    CANCELLED = "cancelled"
    CRASHED = "crashed"  # the controller died and its recovery gave up (no one finished the run)


class AlertStatus(StrEnum):
    SENT = "sent"  # Slack took it
    FAILED = "failed"  # Slack did not take it (the caller may retry: a new row per try)
    LOGGED = "logged"  # no Slack configured: announced in the flow run's log and an artifact
    SUPPRESSED = "suppressed"  # already announced (same dedup key), or nothing to announce


class UTCDateTime(TypeDecorator[datetime]):
    """A timezone-aware UTC datetime on every backend (SQLite keeps no zone: stored as naive UTC)."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError(f"naive datetime {value!r}: pass an aware one, e.g. datetime.now(UTC)")
        value = value.astimezone(UTC)
        return value.replace(tzinfo=None) if dialect.name == "sqlite" else value

    def process_result_value(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)
    type_annotation_map = {datetime: UTCDateTime(), dict[str, Any]: JSON()}


class JobRun(Base):
    """One flow run of a job: every attempt until it completed or gave up."""

    __tablename__ = "job_runs"
    __table_args__ = (
        Index("ix_job_runs_job_started_at", "job", "started_at"),
        Index("ix_job_runs_job_run_key", "job", "run_key"),  # a key's job run, at each of its flow runs
        # newest first, of every job (the unknown-job message) and of one run key (`--run-key`): 0006
        Index("ix_job_runs_started_at_id", "started_at", "id"),
        Index("ix_job_runs_run_key", "run_key"),
    )

    # Made by the client (a UUID), so attempts can name their job run while writes are buffered.
    id: Mapped[str] = mapped_column(String(36), primary_key=True)
    job: Mapped[str] = mapped_column(String(255))
    spec_hash: Mapped[str] = mapped_column(String(128))
    flow_run_id: Mapped[str | None] = mapped_column(String(64))
    storage_uri: Mapped[str] = mapped_column(Text)
    provider: Mapped[str] = mapped_column(String(64))
    status: Mapped[str] = mapped_column(String(16))  # a JobStatus value
    message: Mapped[str] = mapped_column(Text)
    started_at: Mapped[datetime]
    ended_at: Mapped[datetime | None]
    # How many times a new flow run adopted this job run after its controller died.
    controller_restarts: Mapped[int] = mapped_column(Integer, server_default=text("0"))
    # The MLflow run of this job run (tasks/tracking/), once its controller created or re-attached it.
    mlflow_run_id: Mapped[str | None] = mapped_column(String(64))
    # A keyed job (trainer/spec/runs.py): the run key, the template values it was filled with and the
    # runs it was resolved against (warm start, champion), fixed at the key's first flow run; the
    # promotion decision at its end. None for unkeyed jobs and runs before revision 0005.
    run_key: Mapped[str | None] = mapped_column(String(64))
    run_values: Mapped[dict[str, Any] | None]
    lineage: Mapped[dict[str, Any] | None]
    promotion: Mapped[dict[str, Any] | None]


class Attempt(Base):
    """One attempt (append-only): the columns of `tasks.decisions.attempts.AttemptRecord`, plus its job."""

    __tablename__ = "attempts"
    __table_args__ = (
        # The alert automation counts a job's restarts within a time window.
        Index("ix_attempts_job_ended_at", "job", "ended_at"),
        # `spotrun history [JOB]`: the newest attempts, read off an index's end, not sorted (0006)
        Index("ix_attempts_started_at_attempt_id", "started_at", "attempt", "id"),
        Index("ix_attempts_job_started_at_attempt_id", "job", "started_at", "attempt", "id"),
        UniqueConstraint("job_run_id", "attempt"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    job_run_id: Mapped[str] = mapped_column(ForeignKey("job_runs.id", ondelete="CASCADE"))
    job: Mapped[str] = mapped_column(String(255))  # copied from job_runs: windows need no join
    attempt: Mapped[int]
    worker_id: Mapped[str] = mapped_column(Text)
    provider: Mapped[str] = mapped_column(String(64))
    started_at: Mapped[datetime]
    ended_at: Mapped[datetime]
    outcome: Mapped[str] = mapped_column(String(32))  # an Outcome value
    cause: Mapped[str] = mapped_column(Text)
    exit_code: Mapped[int | None]
    signal: Mapped[int | None]
    trainer_code: Mapped[str | None] = mapped_column(String(64))
    error: Mapped[str] = mapped_column(Text)
    log_tail: Mapped[str] = mapped_column(Text)  # bounded by the store
    resumed_from: Mapped[int | None]
    resumed_checkpoint: Mapped[str | None] = mapped_column(Text)
    last_step: Mapped[int]
    last_durable_step: Mapped[int | None]
    lost_steps: Mapped[int]
    notice_lead_s: Mapped[float | None] = mapped_column(Float)
    wall_s: Mapped[float] = mapped_column(Float)
    productive_s: Mapped[float] = mapped_column(Float)
    extra: Mapped[dict[str, Any]]


class CheckpointRejection(Base):
    """A checkpoint the validator refused after an attempt, and why."""

    __tablename__ = "checkpoint_rejections"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    job_run_id: Mapped[str] = mapped_column(ForeignKey("job_runs.id", ondelete="CASCADE"), index=True)
    attempt: Mapped[int]
    step: Mapped[int]
    reasons: Mapped[str] = mapped_column(Text)
    created_at: Mapped[datetime]


class Alert(Base):
    """One try to announce something about a job (append-only): sent, failed, logged or suppressed."""

    __tablename__ = "alerts"
    # The dedup check reads a job's recent alerts of one kind.
    __table_args__ = (Index("ix_alerts_job_kind_created_at", "job", "kind", "created_at"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    dedup_key: Mapped[str] = mapped_column(String(255), index=True)
    kind: Mapped[str] = mapped_column(String(32))  # a tasks.alerts.AlertKind value
    job: Mapped[str] = mapped_column(String(255))
    # No foreign key: an alert may name a job run whose row is still buffered in another process.
    job_run_id: Mapped[str | None] = mapped_column(String(36))
    status: Mapped[str] = mapped_column(String(16))  # an AlertStatus value
    channel: Mapped[str] = mapped_column(String(32))  # "slack-webhook", "slack-api", "log"
    http_status: Mapped[int | None]
    error: Mapped[str] = mapped_column(Text)
    message: Mapped[str] = mapped_column(Text)  # the plain-text summary, bounded by the store
    trigger: Mapped[str] = mapped_column(Text)  # what asked for it, e.g. the Prefect event id
    created_at: Mapped[datetime]


# -- rows: what the store's reads return (plain data, detached from any session) ---------------


@dataclass(kw_only=True)
class AttemptRow(AttemptRecord):
    """An attempt as stored: the record plus the job run it belongs to."""

    job: str
    job_run_id: str


@dataclass(frozen=True)
class JobRunRow:
    id: str
    job: str
    spec_hash: str
    flow_run_id: str | None
    storage_uri: str
    provider: str
    status: JobStatus
    message: str
    started_at: float  # epoch seconds, as in AttemptRecord
    ended_at: float | None
    controller_restarts: int = 0
    mlflow_run_id: str | None = None
    run_key: str | None = None
    run_values: dict[str, Any] | None = None
    lineage: dict[str, Any] | None = None
    promotion: dict[str, Any] | None = None


@dataclass(frozen=True)
class KeyedRun:
    """What a keyed job run is fixed to at its first flow run (tasks/retraining/run_keys.py)."""

    run_key: str | None  # None: an unkeyed job with a warm start or a promotion gate
    run_values: dict[str, str]
    lineage: dict[str, Any]


@dataclass(frozen=True)
class RejectionRow:
    job_run_id: str
    attempt: int
    step: int
    reasons: str
    created_at: float


@dataclass(frozen=True)
class AlertRow:
    id: int
    dedup_key: str
    kind: str
    job: str
    job_run_id: str | None
    status: AlertStatus
    channel: str
    http_status: int | None
    error: str
    message: str
    trigger: str
    created_at: float  # epoch seconds


def attempt_row(a: Attempt) -> AttemptRow:
    v = {f.name: getattr(a, f.name) for f in fields(AttemptRecord)}
    v["outcome"] = Outcome(a.outcome)
    v["started_at"] = a.started_at.timestamp()
    v["ended_at"] = a.ended_at.timestamp()
    return AttemptRow(job=a.job, job_run_id=a.job_run_id, **v)


def job_run_row(r: JobRun) -> JobRunRow:
    return JobRunRow(
        id=r.id,
        job=r.job,
        spec_hash=r.spec_hash,
        flow_run_id=r.flow_run_id,
        storage_uri=r.storage_uri,
        provider=r.provider,
        status=JobStatus(r.status),
        message=r.message,
        started_at=r.started_at.timestamp(),
        ended_at=r.ended_at.timestamp() if r.ended_at is not None else None,
        controller_restarts=r.controller_restarts,
        mlflow_run_id=r.mlflow_run_id,
        run_key=r.run_key,
        run_values=r.run_values,
        lineage=r.lineage,
        promotion=r.promotion,
    )


def rejection_row(r: CheckpointRejection) -> RejectionRow:
    return RejectionRow(
        r.job_run_id, r.attempt, r.step, reasons=r.reasons, created_at=r.created_at.timestamp()
    )


def alert_row(a: Alert) -> AlertRow:
    return AlertRow(
        id=a.id,
        dedup_key=a.dedup_key,
        kind=a.kind,
        job=a.job,
        job_run_id=a.job_run_id,
        status=AlertStatus(a.status),
        channel=a.channel,
        http_status=a.http_status,
        error=a.error,
        message=a.message,
        trigger=a.trigger,
        created_at=a.created_at.timestamp(),
    )
