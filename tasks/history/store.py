"""The restart history in SQL, written so that a database that is down never stops training.

Every write is an `Op` (a name and a JSON payload, see `ops.py`) and goes through `_write`: it first
replays what waits in the journal, in order, then applies its own. When the database cannot be
reached (also at `open`), the write is appended to the journal before `_write` returns, one warning
says so, and each later write retries (connecting and migrating first when that never happened).
Job-run ids are UUIDs made here, so attempts can name their job run before its row exists.

The journal is a file per database when `open` is given a directory (`journal.py`): what waits there
survives the process and is replayed by the next spotrun process that opens the database. Without
one it is memory, lost with the process.
"""

from __future__ import annotations

import json
import logging
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import fields
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TypeVar

from sqlalchemy import Engine, update
from sqlalchemy.orm import Session

from spotrun.tasks.decisions.attempts import AttemptRecord, Outcome
from spotrun.tasks.history.engine import check_database_url, make_engine, one_line, shown_url, unreachable
from spotrun.tasks.history.journal import FileJournal, Journal, MemoryJournal, journal_path
from spotrun.tasks.history.migrations import upgrade_to_head
from spotrun.tasks.history.models import AlertStatus, JobRun, JobStatus, KeyedRun
from spotrun.tasks.history.ops import OPS, Op, stamp
from spotrun.tasks.history.queries import HistoryReads
from spotrun.trainer.storage.locks import LockTimeout

log = logging.getLogger(__name__)

LOG_TAIL_MAX_BYTES = 8 * 1024  # keep the end: the last lines say how it died
ERROR_MAX_CHARS = 4000
ALERT_MESSAGE_MAX_CHARS = 4000
TRIGGER_MAX_CHARS = 1000
_T = TypeVar("_T")


class StoreUnavailable(RuntimeError):
    """The history database cannot be reached for a read."""


class HistoryStore(HistoryReads):
    """Job runs, attempts, checkpoint rejections and alerts in SQL (SQLite or PostgreSQL)."""

    def __init__(self, engine: Engine, journal: Journal | None = None) -> None:
        self._engine = engine
        self.url = shown_url(engine.url)
        self._lock = threading.RLock()
        self._journal: Journal = journal if journal is not None else MemoryJournal()
        self._ready = False  # connected once and migrated
        self._down = False  # in an outage that has been reported
        self._reason = ""
        self._job_names: dict[str, str] = {}

    @classmethod
    def open(
        cls, url: str, *, journal_dir: Path | None = None, connect_timeout_s: float = 5.0
    ) -> HistoryStore:
        """Open (and migrate) the database and replay its journal; never raises because it is down.

        With `journal_dir` (Settings.journal_dir) writes that cannot reach the database wait in a
        file there, replayed by the next process that opens it; without, in memory only.
        """
        engine = make_engine(check_database_url(url), connect_timeout_s)
        rendered = engine.url.render_as_string(hide_password=True)
        journal = FileJournal(journal_path(journal_dir, rendered)) if journal_dir is not None else None
        store = cls(engine, journal)
        with store._lock:
            store._drain()
        return store

    # -- writes ---------------------------------------------------------------------------------

    def start_job_run(
        self,
        job: str,
        spec_hash: str,
        flow_run_id: str | None,
        *,
        storage_uri: str,
        provider: str,
        keyed: KeyedRun | None = None,
    ) -> str:
        """Record a new job run as running; returns its id (usable at once, even while buffered).
        `keyed`: a keyed job's run key, template values and lineage (fixed here, at its first flow run)."""
        run_id = str(uuid.uuid4())
        args: dict[str, Any] = dict(
            id=run_id,
            job=job,
            spec_hash=spec_hash,
            flow_run_id=flow_run_id,
            storage_uri=storage_uri,
            provider=provider,
            status=JobStatus.RUNNING.value,
            message="",
            started_at=stamp(datetime.now(UTC)),
        )
        if keyed is not None:
            args |= dict(run_key=keyed.run_key, run_values=keyed.run_values, lineage=keyed.lineage)
        self._job_names[run_id] = job
        self._write(Op("start_job_run", args, f"job run {run_id} of {job}"))
        return run_id

    def record_attempt(self, job_run_id: str, record: AttemptRecord) -> None:
        """Append one attempt (log tail bounded to LOG_TAIL_MAX_BYTES)."""
        job = self._job_names.get(job_run_id)  # else the replay looks it up
        args = dict(job_run_id=job_run_id, job=job, record=_attempt_values(record))
        self._write(Op("record_attempt", args, f"attempt {record.attempt} of job run {job_run_id}"))

    def record_rejections(self, job_run_id: str, attempt: int, rejections: Sequence[tuple[int, str]]) -> None:
        """Record the checkpoints (step, reasons) the validator refused after `attempt`."""
        if not rejections:
            return
        rows = [[int(step), str(reasons)] for step, reasons in rejections]
        args = dict(job_run_id=job_run_id, attempt=attempt, rows=rows, created_at=stamp(datetime.now(UTC)))
        what = f"{len(rows)} rejection(s) after attempt {attempt} of {job_run_id}"
        self._write(Op("record_rejections", args, what))

    def finish_job_run(self, job_run_id: str, status: JobStatus | str, message: str = "") -> None:
        """Mark a job run completed, failed, cancelled or crashed, with the one line that says why."""
        final = JobStatus(status)
        ended = stamp(datetime.now(UTC))
        args = dict(job_run_id=job_run_id, status=final.value, message=message, ended_at=ended)
        self._write(Op("finish_job_run", args, f"end ({final.value}) of job run {job_run_id}"))

    def adopt_job_run(self, job_run_id: str, flow_run_id: str | None) -> None:
        """Relink a running job run whose controller died to `flow_run_id`, counting the restart."""
        args = dict(job_run_id=job_run_id, flow_run_id=flow_run_id)
        self._write(Op("adopt_job_run", args, f"adoption of job run {job_run_id} by flow run {flow_run_id}"))

    def annotate_job_run(self, job_run_id: str, field: str, value: dict[str, Any]) -> None:
        """Set a keyed run's `lineage` (what the trainer loaded) or `promotion` (the decision at its end)."""
        if field not in ANNOTATIONS:
            raise ValueError(f"{field!r} is not one of {', '.join(ANNOTATIONS)}")
        args = dict(job_run_id=job_run_id, field=field, value=value)
        self._write(Op("annotate_job_run", args, f"{field} of job run {job_run_id}"))

    def set_mlflow_run(self, job_run_id: str, mlflow_run_id: str) -> None:
        """Name the MLflow run the job run's metrics go to (the same id again changes nothing)."""
        args = dict(job_run_id=job_run_id, mlflow_run_id=mlflow_run_id)
        self._write(Op("set_mlflow_run", args, f"MLflow run {mlflow_run_id} of job run {job_run_id}"))

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
        args: dict[str, Any] = dict(
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
            created_at=stamp(created_at or datetime.now(UTC)),
        )
        self._write(Op("record_alert", args, f"{args['status']} alert {dedup_key}"))

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
        """How many writes wait in the journal for the database (from any process, for a file)."""
        return len(self._journal)

    @property
    def journal(self) -> str:
        """Where waiting writes are kept: the journal file's path, or "memory"."""
        return self._journal.where

    def close(self) -> None:
        """Try the waiting writes once more, say where they are kept, and release the connections."""
        with self._lock:
            if not self._drain():
                n = len(self._journal)
                if isinstance(self._journal, MemoryJournal):
                    log.warning("history database %s unavailable at close: %d record(s) lost", self.url, n)
                else:
                    log.warning(
                        "history database %s still unavailable at close: %d record(s) kept in the journal %s,"
                        " replayed when a spotrun process next opens this database",
                        self.url,
                        n,
                        self._journal.where,
                    )
            self._engine.dispose()

    def __enter__(self) -> HistoryStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals ------------------------------------------------------------------------------

    def _write(self, op: Op) -> None:
        """Apply `op` after every write that waits before it; journal it when the database is down."""
        with self._lock:
            if self._drain():
                try:
                    self._apply(op, replay=False)
                    return
                except Exception as e:  # only a connection failure is journaled; the caller's error raises
                    if not unreachable(e):
                        raise
                    self._reason = one_line(e)
            self._keep(op)
            self._report_down()

    def _keep(self, op: Op) -> None:
        """Journal `op` (it may have landed before the connection broke: replays check)."""
        try:
            self._journal.append(op)
        except (OSError, LockTimeout) as e:  # a full disk or a hung holder must not stop training either
            log.error(
                "history journal %s cannot be written (%s): waiting records kept in memory only",
                self._journal.where,
                one_line(e),
            )
            self._journal = MemoryJournal()
            self._journal.append(op)

    def _drain(self) -> bool:
        """Replay the journal in order (any process's writes); True when nothing waits any more."""
        if not self._connect():
            return False
        written = 0

        def replay(op: Op) -> bool:
            nonlocal written
            try:
                self._apply(op, replay=True)
            except Exception as e:  # every failure is sorted here: stop (keep it) or drop it
                if unreachable(e):
                    self._reason = one_line(e)
                    return False
                log.error("history: dropped waiting %s: %s", op.what, one_line(e))
                return True
            written += 1
            return True

        try:
            drained = self._journal.replay(replay)
        except LockTimeout as e:  # another process hangs holding the journal: its records wait
            log.warning("history journal not replayed now: %s", e)
            return False
        if not drained:
            return False
        if self._down or written:
            self._down = False
            log.info("history database %s is back: wrote %d waiting record(s)", self.url, written)
        return True

    def _apply(self, op: Op, replay: bool) -> None:
        with Session(self._engine, expire_on_commit=False) as s, s.begin():
            if self._engine.dialect.name == "sqlite":
                # Take the write lock first: a read-then-write transaction can deadlock with
                # another process's and fail at once instead of waiting out the busy timeout.
                s.connection().exec_driver_sql("BEGIN IMMEDIATE")
            op.apply(s, replay)

    def _connect(self) -> bool:
        """Connect and migrate once; False while the database cannot be reached."""
        if self._ready:
            return True
        try:
            database = self._engine.url.database
            if self._engine.url.get_backend_name() == "sqlite" and database not in (None, "", ":memory:"):
                Path(database).parent.mkdir(parents=True, exist_ok=True)
            upgrade_to_head(self._engine)
        except Exception as e:  # connection-level failures buffer; anything else is a real error
            if not unreachable(e):
                raise
            self._reason = one_line(e)
            return False
        self._ready = True
        return True

    def _report_down(self) -> None:
        """Warn once per outage, after the first write that waits for it."""
        if self._down:
            log.debug("history database %s still unavailable: %s", self.url, self._reason)
            return
        self._down = True
        memory = isinstance(self._journal, MemoryJournal)
        kept = "in memory" if memory else f"in the journal {self._journal.where}"
        log.warning(
            "history database %s unavailable (%s): %d record(s) buffered %s, training continues;"
            " retrying on each write",
            self.url,
            self._reason,
            len(self._journal),
            kept,
        )

    def _read(self, query: Callable[[Session], _T]) -> _T:
        with self._lock:
            try:
                if self._drain():  # read what this process wrote, too
                    with Session(self._engine, expire_on_commit=False) as s:
                        return query(s)
            except Exception as e:  # only a connection failure becomes StoreUnavailable
                if not unreachable(e):
                    raise
                self._reason = one_line(e)
            raise StoreUnavailable(
                f"history database {self.url} is unreachable ({self._reason}): start it, or point"
                " SPOTRUN_DATABASE_URL at one that answers"
            )


def _set_mlflow_run(s: Session, a: dict[str, Any], replay: bool) -> None:
    """An absolute value: a replay sets the same id again. A job run not there (yet) is an error."""
    done = s.execute(
        update(JobRun).where(JobRun.id == a["job_run_id"]).values(mlflow_run_id=a["mlflow_run_id"])
    )
    if done.rowcount == 0:  # type: ignore[attr-defined]
        raise LookupError(f"no job run {a['job_run_id']}")


def _annotate_job_run(s: Session, a: dict[str, Any], replay: bool) -> None:
    """An absolute value, as above: a replay writes the same JSON again."""
    values = {a["field"]: a["value"]}
    done = s.execute(update(JobRun).where(JobRun.id == a["job_run_id"]).values(**values))
    if done.rowcount == 0:  # type: ignore[attr-defined]
        raise LookupError(f"no job run {a['job_run_id']}")


# Registered here rather than in ops.py beside the others: the writes of the tracking work (0004) and
# of keyed runs (0005).
OPS["set_mlflow_run"] = _set_mlflow_run
OPS["annotate_job_run"] = _annotate_job_run
ANNOTATIONS = ("lineage", "promotion")


def _bounded_tail(text: str, max_bytes: int = LOG_TAIL_MAX_BYTES) -> str:
    data = text.encode("utf-8", errors="replace")
    if len(data) <= max_bytes:
        return text
    return data[-max_bytes:].decode("utf-8", errors="ignore")  # drop a character cut in half


def _attempt_values(r: AttemptRecord) -> dict[str, Any]:
    """The record as a JSON payload, copied now: the caller may change it while it waits."""
    v = {f.name: getattr(r, f.name) for f in fields(AttemptRecord)}
    v["outcome"] = Outcome(r.outcome).value
    v["started_at"] = stamp(datetime.fromtimestamp(r.started_at, UTC))
    v["ended_at"] = stamp(datetime.fromtimestamp(r.ended_at, UTC))
    v["error"] = r.error[:ERROR_MAX_CHARS]
    v["log_tail"] = _bounded_tail(r.log_tail)
    v["extra"] = json.loads(json.dumps(r.extra, default=str))
    return v
