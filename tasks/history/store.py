"""The restart history in SQL, written so that a database that is down never stops training.

Every write goes through `_write`: it first writes what earlier writes left buffered, in order, then
its own. When the database cannot be reached (also at `open`), writes wait in memory, one warning
says so, and each later write retries (connecting and migrating first when that never happened).
Job-run ids are UUIDs made here, so attempts can name their job run before its row exists.

Buffered writes live in memory only: they are lost if the process ends before the database returns.
"""

from __future__ import annotations

import json
import logging
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TypeVar

from sqlalchemy import Engine, create_engine, event, select, update
from sqlalchemy import exc as sa_exc
from sqlalchemy.engine import URL, make_url
from sqlalchemy.orm import Session

from tasks.attempts import AttemptRecord, Outcome
from tasks.history.migrations import upgrade_to_head
from tasks.history.models import (
    Alert,
    AlertRow,
    AlertStatus,
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

log = logging.getLogger(__name__)

LOG_TAIL_MAX_BYTES = 8 * 1024  # keep the end: the last lines say how it died
ERROR_MAX_CHARS = 4000
ALERT_MESSAGE_MAX_CHARS = 4000
TRIGGER_MAX_CHARS = 1000
_T = TypeVar("_T")


class StoreUnavailable(RuntimeError):
    """The history database cannot be reached for a read."""


def default_url(home: Path) -> str:
    """The embedded default: a SQLite file in the spotrun home."""
    return f"sqlite:///{(home / 'history.db').absolute()}"


def normalize_url(url: str) -> URL:
    """Parse a database URL; plain PostgreSQL URLs (and asyncpg ones) get the sync psycopg driver."""
    try:
        u = make_url(url)
    except sa_exc.ArgumentError as e:
        raise ValueError(f"database URL {url!r} is not a URL: write sqlite:///PATH or postgresql://…") from e
    if u.drivername in ("postgres", "postgresql", "postgresql+asyncpg"):
        u = u.set(drivername="postgresql+psycopg")
    return u


@dataclass
class _Write:
    what: str  # for logs: "attempt 3 of job run 1f0c…"
    apply: Callable[[Session], None]
    tried: bool = False  # once tried, a connection error leaves it unknown whether it landed


class HistoryStore:
    """Job runs, attempts, checkpoint rejections and alerts in SQL (SQLite or PostgreSQL)."""

    def __init__(self, engine: Engine) -> None:
        self._engine = engine
        self.url = engine.url.render_as_string(hide_password=True)
        self._lock = threading.RLock()
        self._pending: deque[_Write] = deque()
        self._ready = False  # connected once and migrated
        self._down = False  # in an outage that has been reported
        self._reason = ""
        self._job_names: dict[str, str] = {}

    @classmethod
    def open(cls, url: str, *, connect_timeout_s: float = 5.0) -> HistoryStore:
        """Open (and migrate) the database; never raises because it is down: it buffers instead."""
        store = cls(_make_engine(normalize_url(url), connect_timeout_s))
        with store._lock:
            store._connect()
        return store

    # -- writes ---------------------------------------------------------------------------------

    def start_job_run(
        self, job: str, spec_hash: str, flow_run_id: str | None, storage_uri: str, provider: str
    ) -> str:
        """Record a new job run as running; returns its id (usable at once, even while buffered)."""
        run_id = str(uuid.uuid4())
        values: dict[str, Any] = dict(
            id=run_id,
            job=job,
            spec_hash=spec_hash,
            flow_run_id=flow_run_id,
            storage_uri=storage_uri,
            provider=provider,
            status=JobStatus.RUNNING.value,
            message="",
            started_at=datetime.now(UTC),
            ended_at=None,
        )
        self._job_names[run_id] = job
        self._write(_Write(f"job run {run_id} of {job}", lambda s: s.add(JobRun(**values))))
        return run_id

    def record_attempt(self, job_run_id: str, record: AttemptRecord) -> None:
        """Append one attempt (log tail bounded to LOG_TAIL_MAX_BYTES)."""
        values = _attempt_values(record)
        job = self._job_names.get(job_run_id)

        def apply(s: Session) -> None:
            name = job if job is not None else s.scalar(select(JobRun.job).where(JobRun.id == job_run_id))
            if name is None:
                raise LookupError(f"no job run {job_run_id} in {self.url}")
            s.add(Attempt(job_run_id=job_run_id, job=name, **values))

        self._write(_Write(f"attempt {record.attempt} of job run {job_run_id}", apply))

    def record_rejections(self, job_run_id: str, attempt: int, rejections: Sequence[tuple[int, str]]) -> None:
        """Record the checkpoints (step, reasons) the validator refused after `attempt`."""
        if not rejections:
            return
        now = datetime.now(UTC)
        rows = [(int(step), str(reasons)) for step, reasons in rejections]

        def apply(s: Session) -> None:
            s.add_all(
                CheckpointRejection(
                    job_run_id=job_run_id, attempt=attempt, step=st, reasons=r, created_at=now
                )
                for st, r in rows
            )

        self._write(_Write(f"{len(rows)} rejection(s) after attempt {attempt} of {job_run_id}", apply))

    def finish_job_run(self, job_run_id: str, status: JobStatus | str, message: str = "") -> None:
        """Mark a job run completed, failed or cancelled, with the one line that says why."""
        final = JobStatus(status)
        now = datetime.now(UTC)

        def apply(s: Session) -> None:
            done = s.execute(
                update(JobRun)
                .where(JobRun.id == job_run_id)
                .values(status=final.value, message=message, ended_at=now)
            )
            if done.rowcount == 0:  # type: ignore[attr-defined]
                raise LookupError(f"no job run {job_run_id} in {self.url}")

        self._write(_Write(f"end ({final.value}) of job run {job_run_id}", apply))

    def record_alert(
        self,
        *,
        dedup_key: str,
        kind: str,
        job: str,
        status: AlertStatus | str,
        channel: str,
        job_run_id: str | None = None,
        http_status: int | None = None,
        error: str = "",
        message: str = "",
        trigger: str = "",
        created_at: datetime | None = None,
    ) -> None:
        """Append one alert try (message, error and trigger bounded); `created_at` defaults to now."""
        if created_at is not None and created_at.tzinfo is None:
            raise ValueError(f"created_at={created_at!r} is naive: pass an aware datetime")
        values: dict[str, Any] = dict(
            dedup_key=dedup_key,
            kind=str(kind),
            job=job,
            job_run_id=job_run_id,
            status=AlertStatus(status).value,
            channel=channel,
            http_status=http_status,
            error=error[:ERROR_MAX_CHARS],
            message=message[:ALERT_MESSAGE_MAX_CHARS],
            trigger=trigger[:TRIGGER_MAX_CHARS],
            created_at=created_at or datetime.now(UTC),
        )
        self._write(_Write(f"{values['status']} alert {dedup_key}", lambda s: s.add(Alert(**values))))

    def flush(self, timeout_s: float = 10.0) -> bool:
        """Retry buffered writes until none is left or `timeout_s` passed; True when all are written."""
        deadline = time.monotonic() + timeout_s
        while True:
            with self._lock:
                if self._drain():
                    return True
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            time.sleep(min(0.2, left))

    @property
    def pending(self) -> int:
        """How many writes wait in memory for the database."""
        return len(self._pending)

    def close(self) -> None:
        """Try the buffered writes once more, say what is lost, and release the connections."""
        with self._lock:
            if not self._drain():
                log.warning(
                    "history database %s still unavailable at close: %d buffered record(s) not written",
                    self.url,
                    len(self._pending),
                )
            self._engine.dispose()

    def __enter__(self) -> HistoryStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- reads ----------------------------------------------------------------------------------

    def attempts(
        self, job: str | None = None, job_run_id: str | None = None, limit: int = 200
    ) -> list[AttemptRow]:
        """The newest `limit` attempts (of a job, or of a job run), oldest first."""
        q = select(Attempt)
        if job is not None:
            q = q.where(Attempt.job == job)
        if job_run_id is not None:
            q = q.where(Attempt.job_run_id == job_run_id)
        q = q.order_by(Attempt.started_at.desc(), Attempt.attempt.desc(), Attempt.id.desc()).limit(limit)
        return [attempt_row(a) for a in reversed(self._read(lambda s: list(s.scalars(q))))]

    def job_runs(self, job: str | None = None, limit: int = 50) -> list[JobRunRow]:
        """The newest `limit` job runs (of a job), oldest first."""
        q = select(JobRun)
        if job is not None:
            q = q.where(JobRun.job == job)
        q = q.order_by(JobRun.started_at.desc(), JobRun.id.desc()).limit(limit)
        return [job_run_row(r) for r in reversed(self._read(lambda s: list(s.scalars(q))))]

    def latest_job_run(self, job: str) -> JobRunRow | None:
        """The job's most recently started job run, if any."""
        runs = self.job_runs(job, limit=1)
        return runs[-1] if runs else None

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

    # -- internals ------------------------------------------------------------------------------

    def _write(self, w: _Write) -> None:
        with self._lock:
            self._pending.append(w)
            self._drain(own=w)

    def _drain(self, own: _Write | None = None) -> bool:
        """Write the buffered writes in order; True when none is left. Raises `own`'s own errors."""
        if not self._connect():
            return False
        written = 0
        while self._pending:
            w = self._pending[0]
            try:
                with Session(self._engine, expire_on_commit=False) as s, s.begin():
                    if self._engine.dialect.name == "sqlite":
                        # Take the write lock first: a read-then-write transaction can deadlock with
                        # another process's and fail at once instead of waiting out the busy timeout.
                        s.connection().exec_driver_sql("BEGIN IMMEDIATE")
                    w.apply(s)
            except Exception as e:  # every failure is sorted here: buffer, raise to the caller, or drop
                if _unreachable(e):
                    w.tried = True
                    self._went_down(e)
                    return False
                self._pending.popleft()
                if w is own:
                    raise  # the caller's own write is wrong (a duplicate attempt, an unknown job run)
                if w.tried and isinstance(e, sa_exc.IntegrityError):
                    log.info("history: %s was already written before the connection broke", w.what)
                else:
                    log.error("history: dropped buffered %s: %s", w.what, _one_line(e))
                continue
            self._pending.popleft()
            written += 1
        if self._down:
            self._down = False
            log.info("history database %s is back: wrote %d buffered record(s)", self.url, written)
        return True

    def _connect(self) -> bool:
        """Connect and migrate once; False (and buffering) while the database cannot be reached."""
        if self._ready:
            return True
        try:
            database = self._engine.url.database
            if self._engine.url.get_backend_name() == "sqlite" and database not in (None, "", ":memory:"):
                Path(database).parent.mkdir(parents=True, exist_ok=True)
            upgrade_to_head(self._engine)
        except Exception as e:  # connection-level failures buffer; anything else is a real error
            if not _unreachable(e):
                raise
            self._went_down(e)
            return False
        self._ready = True
        return True

    def _went_down(self, e: BaseException) -> None:
        self._reason = _one_line(e)
        if self._down or not self._pending:  # warn once per outage, when something waits for it
            log.debug("history database %s still unavailable: %s", self.url, self._reason)
            return
        self._down = True
        log.warning(
            "history database %s unavailable (%s): %d record(s) buffered in memory, training continues;"
            " retrying on each write",
            self.url,
            self._reason,
            len(self._pending),
        )

    def _read(self, query: Callable[[Session], _T]) -> _T:
        with self._lock:
            try:
                if self._drain():  # read what this process wrote, too
                    with Session(self._engine, expire_on_commit=False) as s:
                        return query(s)
            except Exception as e:  # only a connection failure becomes StoreUnavailable
                if not _unreachable(e):
                    raise
                self._reason = _one_line(e)
            raise StoreUnavailable(
                f"history database {self.url} is unreachable ({self._reason}): start it, or point"
                " SPOTRUN_DATABASE_URL at one that answers"
            )


def _make_engine(url: URL, connect_timeout_s: float) -> Engine:
    if url.get_backend_name() == "postgresql":
        return create_engine(
            url, pool_pre_ping=True, connect_args={"connect_timeout": max(2, round(connect_timeout_s))}
        )
    if url.get_backend_name() != "sqlite":
        return create_engine(url, pool_pre_ping=True)
    # The busy timeout: wait out another process's write (or migration) instead of failing.
    engine = create_engine(url, pool_pre_ping=True, connect_args={"timeout": 30.0})

    @event.listens_for(engine, "connect")
    def _foreign_keys_on(dbapi_conn: Any, _record: Any) -> None:  # as PostgreSQL enforces them
        cur = dbapi_conn.cursor()
        cur.execute("PRAGMA foreign_keys = ON")
        cur.close()

    return engine


def _unreachable(e: BaseException) -> bool:
    """A connection-level failure: retrying later may succeed."""
    if isinstance(e, sa_exc.DBAPIError) and e.connection_invalidated:
        return True
    connection_level = (sa_exc.OperationalError, sa_exc.InterfaceError, sa_exc.DisconnectionError)
    return isinstance(e, (*connection_level, sa_exc.TimeoutError, OSError))


def _one_line(e: BaseException) -> str:
    cause = getattr(e, "orig", None) or e  # the driver's message, without SQLAlchemy's SQL echo
    first = (str(cause).strip().splitlines() or [""])[0]
    return f"{type(cause).__name__}: {first}"[:300]


def _bounded_tail(text: str, max_bytes: int = LOG_TAIL_MAX_BYTES) -> str:
    data = text.encode("utf-8", errors="replace")
    if len(data) <= max_bytes:
        return text
    return data[-max_bytes:].decode("utf-8", errors="ignore")  # drop a character cut in half


def _attempt_values(r: AttemptRecord) -> dict[str, Any]:
    """The record as column values, copied now: the caller may change it while it is buffered."""
    v = {f.name: getattr(r, f.name) for f in fields(AttemptRecord)}
    v["outcome"] = Outcome(r.outcome).value
    v["started_at"] = datetime.fromtimestamp(r.started_at, UTC)
    v["ended_at"] = datetime.fromtimestamp(r.ended_at, UTC)
    v["error"] = r.error[:ERROR_MAX_CHARS]
    v["log_tail"] = _bounded_tail(r.log_tail)
    v["extra"] = json.loads(json.dumps(r.extra, default=str))
    return v
