"""Restart history on real databases: a SQLite file, and PostgreSQL on 127.0.0.1:5432 when one answers.

The databases, the relay that takes PostgreSQL down and the record helpers are in `databases.py`.
"""

from __future__ import annotations

import logging
import subprocess
import sys
import threading
import time
import uuid
from datetime import UTC, datetime
from pathlib import Path

import pytest
from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import create_engine, insert, inspect

from spotrun.tasks.decisions.attempts import Outcome
from spotrun.tasks.history import (
    AlertStatus,
    HistoryStore,
    JobStatus,
    StoreUnavailable,
    database_url,
    default_url,
)
from spotrun.tasks.history.engine import normalize_url
from spotrun.tasks.history.migrations import (
    VERSION_TABLE,
    alembic_config,
    current_revision,
    head_revision,
    upgrade_to_head,
)
from spotrun.tasks.history.models import Base, JobRun
from spotrun.tasks.history.store import ALERT_MESSAGE_MAX_CHARS, LOG_TAIL_MAX_BYTES
from spotrun.trainer.errors import ConfigError
from tests.integration.databases import (
    T0,
    Outage,
    Relay,
    free_port,
    new_run,
    new_schema,
    pg_url,
    record,
    same_record,
)

TABLES = {"job_runs", "attempts", "checkpoint_rejections", "alerts"}
STORE_LOG = "spotrun.tasks.history.store"


def table_names(url: str) -> set[str]:
    engine = create_engine(normalize_url(url))
    try:
        return set(inspect(engine).get_table_names())
    finally:
        engine.dispose()


# -- schema ---------------------------------------------------------------------------------------


def test_migrates_on_first_use_and_is_idempotent(db_url: str) -> None:
    with HistoryStore.open(db_url) as store:
        run = new_run(store)
        assert store.pending == 0
    assert table_names(db_url) >= TABLES
    engine = create_engine(normalize_url(db_url))
    with engine.connect() as conn:
        assert current_revision(conn) == head_revision() == "0006"
    upgrade_to_head(engine)  # at head: nothing to do
    engine.dispose()
    with HistoryStore.open(db_url) as again:
        assert [r.id for r in again.job_runs()] == [run]


def test_models_match_migration(db_url: str) -> None:
    upgrade_to_head(normalize_url(db_url).render_as_string(hide_password=False))
    engine = create_engine(normalize_url(db_url))
    with engine.connect() as conn:
        ctx = MigrationContext.configure(conn, opts={"version_table": VERSION_TABLE})
        assert compare_metadata(ctx, Base.metadata) == []
    engine.dispose()


def test_upgrade_head_then_downgrade_base(db_url: str) -> None:
    engine = create_engine(normalize_url(db_url))
    with engine.connect() as conn:
        command.upgrade(alembic_config(conn), "head")
        conn.commit()
    assert table_names(db_url) >= TABLES
    with engine.connect() as conn:
        command.downgrade(alembic_config(conn), "base")
        conn.commit()
        assert current_revision(conn) is None
    assert table_names(db_url) & TABLES == set()
    upgrade_to_head(engine)
    assert table_names(db_url) >= TABLES
    engine.dispose()


def test_a_database_at_0001_upgrades_on_open_and_keeps_its_rows(db_url: str) -> None:
    run = str(uuid.uuid4())
    engine = create_engine(normalize_url(db_url))
    with engine.connect() as conn:  # what spotrun before the alerts table left behind
        command.upgrade(alembic_config(conn), "0001")
        conn.execute(
            insert(JobRun).values(
                id=run,
                job="digits",
                spec_hash="sha256:abc",
                flow_run_id=None,
                storage_uri="file:///tmp/ckpt/digits",
                provider="local",
                status="failed",
                message="gave up",
                started_at=datetime.fromtimestamp(T0, UTC),
                ended_at=None,
            )
        )
        conn.commit()
    assert "alerts" not in table_names(db_url)

    with HistoryStore.open(db_url) as store:
        assert [(r.id, r.status) for r in store.job_runs()] == [(run, JobStatus.FAILED)]
        store.record_alert(
            dedup_key=f"gave-up:digits:{run}", kind="gave-up", job="digits", status="logged", channel="log"
        )
        assert [(a.job_run_id, a.status) for a in store.alerts()] == [(None, AlertStatus.LOGGED)]
    with engine.connect() as conn:
        assert current_revision(conn) == head_revision()
    engine.dispose()


# -- round trip -----------------------------------------------------------------------------------


def test_round_trip(db_url: str) -> None:
    recs = [
        record(1, resumed_from=None, last_step=130, last_durable_step=100, lost_steps=30, notice_lead_s=2.25),
        record(
            2,
            Outcome.CRASHED,
            exit_code=1,
            trainer_code="ERROR",
            error="RuntimeError: loss is NaN at step 170",
            log_tail="Traceback (most recent call last):\n  ...\nRuntimeError: loss is NaN\n",
            resumed_from=100,
            resumed_checkpoint="file:///tmp/ckpt/digits/step-00000100",
            last_step=170,
            wall_s=60.5,
            productive_s=40.0,
            extra={"zone": "z1", "steps_per_s": [1.5, 2.0]},
        ),
        record(3, Outcome.COMPLETED, signal=None, exit_code=0, resumed_from=150, last_step=300),
    ]
    with HistoryStore.open(db_url) as store:
        run = new_run(store)
        for r in recs:
            store.record_attempt(run, r)
        store.record_rejections(run, 2, [(160, "manifest sha256 mismatch"), (150, "missing COMMIT")])
        store.finish_job_run(run, JobStatus.COMPLETED, "trained to step 300 in 3 attempts")

        rows = store.attempts(job_run_id=run)
        assert [r.attempt for r in rows] == [1, 2, 3]
        for row, rec in zip(rows, recs, strict=True):
            same_record(row, rec)
            assert (row.job, row.job_run_id) == ("digits", run)
        assert isinstance(rows[1].outcome, Outcome)

        (jr,) = store.job_runs("digits")
        assert (jr.id, jr.status, jr.message) == (
            run,
            JobStatus.COMPLETED,
            "trained to step 300 in 3 attempts",
        )
        assert (jr.spec_hash, jr.flow_run_id, jr.provider) == ("sha256:abc", "flow-run-1", "local")
        assert jr.ended_at is not None and jr.ended_at >= jr.started_at
        assert [(r.attempt, r.step, r.reasons) for r in store.rejections(run)] == [
            (2, 160, "manifest sha256 mismatch"),
            (2, 150, "missing COMMIT"),
        ]


def test_ordering_and_limits(db_url: str) -> None:
    with HistoryStore.open(db_url) as store:
        first, second = new_run(store), new_run(store)
        other = new_run(store, job="charlm")
        for n in (1, 2):
            store.record_attempt(first, record(n))
        for n in (1, 2, 3):
            store.record_attempt(second, record(n, start=T0 + 1000))
        store.record_attempt(other, record(1, start=T0 + 500))

        assert [(r.job_run_id, r.attempt) for r in store.attempts("digits")] == [
            (first, 1),
            (first, 2),
            (second, 1),
            (second, 2),
            (second, 3),
        ]
        assert [(r.job_run_id, r.attempt) for r in store.attempts("digits", limit=2)] == [
            (second, 2),
            (second, 3),
        ]
        assert [r.job for r in store.attempts()] == ["digits"] * 2 + ["charlm"] + ["digits"] * 3
        assert [r.id for r in store.job_runs("digits")] == [first, second]
        assert [r.id for r in store.job_runs(limit=1)] == [other]


def test_restarts_within_window(db_url: str) -> None:
    now = T0 + 10_000
    with HistoryStore.open(db_url) as store:
        run, other = new_run(store), new_run(store, job="charlm")
        ended = {1: now - 3600, 2: now - 140, 3: now - 40, 4: now - 10}
        outcomes = {1: Outcome.PREEMPTED, 2: Outcome.CRASHED, 3: Outcome.LOST, 4: Outcome.COMPLETED}
        for n, end in ended.items():
            store.record_attempt(run, record(n, outcomes[n], started_at=end - 60, ended_at=end))
        store.record_attempt(other, record(1, started_at=now - 100, ended_at=now - 40))

        since = datetime.fromtimestamp(now - 600, UTC)
        assert [(r.attempt, r.outcome) for r in store.restarts_within("digits", since)] == [
            (2, Outcome.CRASHED),
            (3, Outcome.LOST),
        ]
        assert store.restarts_within("digits", datetime.fromtimestamp(now, UTC)) == []
        with pytest.raises(ValueError, match="naive"):
            store.restarts_within("digits", datetime(2024, 1, 1))


def test_alerts_round_trip_and_filters(db_url: str) -> None:
    at = [datetime.fromtimestamp(T0 + 60 * i, UTC) for i in range(4)]
    with HistoryStore.open(db_url) as store:
        assert store.latest_job_run("digits") is None
        first, second = new_run(store), new_run(store)
        store.record_alert(
            dedup_key="restart-storm:digits:20231114T221320Z",
            kind="restart-storm",
            job="digits",
            job_run_id=second,
            status=AlertStatus.FAILED,
            channel="slack-webhook",
            error="no answer from http://127.0.0.1:9: URLError: Connection refused",
            message="spotrun: digits restarted 3 times in 1 h",
            trigger="event-1",
            created_at=at[0],
        )
        store.record_alert(
            dedup_key="restart-storm:digits:20231114T221320Z",
            kind="restart-storm",
            job="digits",
            job_run_id=second,
            status="sent",
            channel="slack-webhook",
            http_status=200,
            message="x" * (ALERT_MESSAGE_MAX_CHARS + 500),
            created_at=at[1],
        )
        store.record_alert(
            dedup_key="k3", kind="gave-up", job="digits", status="sent", channel="slack-api", created_at=at[2]
        )
        store.record_alert(
            dedup_key="k4",
            kind="restart-storm",
            job="charlm",
            status="suppressed",
            channel="log",
            created_at=at[3],
        )

        rows = store.alerts()
        assert [r.dedup_key for r in rows] == ["restart-storm:digits:20231114T221320Z"] * 2 + ["k3", "k4"]
        failed, sent = rows[0], rows[1]
        assert (failed.status, failed.channel, failed.http_status, failed.job_run_id) == (
            AlertStatus.FAILED,
            "slack-webhook",
            None,
            second,
        )
        assert (failed.error, failed.trigger, failed.created_at) == (
            "no answer from http://127.0.0.1:9: URLError: Connection refused",
            "event-1",
            T0,
        )
        assert (sent.status, sent.http_status, len(sent.message)) == (
            AlertStatus.SENT,
            200,
            ALERT_MESSAGE_MAX_CHARS,
        )
        assert isinstance(rows[3].status, AlertStatus) and rows[3].job_run_id is None

        assert [r.dedup_key for r in store.alerts("digits", kind="gave-up")] == ["k3"]
        assert [r.created_at for r in store.alerts("digits", since=at[1])] == [T0 + 60, T0 + 120]
        assert [r.dedup_key for r in store.alerts(limit=2)] == ["k3", "k4"]  # the newest, oldest first
        assert store.alerts("nobody") == []
        latest = store.latest_job_run("digits")
        assert latest is not None and latest.id in (first, second)
        assert latest.id == store.job_runs("digits")[-1].id
        with pytest.raises(ValueError, match="naive"):
            store.alerts(since=datetime(2024, 1, 1))
        with pytest.raises(ValueError, match="naive"):
            store.record_alert(
                dedup_key="k",
                kind="gave-up",
                job="d",
                status="sent",
                channel="log",
                created_at=datetime(2024, 1, 1),
            )
        with pytest.raises(ValueError):
            store.record_alert(dedup_key="k", kind="gave-up", job="d", status="delivered", channel="log")
        assert store.pending == 0


def test_log_tail_is_bounded_keeping_the_end(db_url: str) -> None:
    tail = "".join(f"step {i}: loss ü{i}\n" for i in range(5000)) + "Killed\n"
    with HistoryStore.open(db_url) as store:
        run = new_run(store)
        store.record_attempt(run, record(1, log_tail=tail))
        (row,) = store.attempts(job_run_id=run)
    assert len(row.log_tail.encode()) <= LOG_TAIL_MAX_BYTES
    assert len(row.log_tail.encode()) > LOG_TAIL_MAX_BYTES - 4
    assert tail.endswith(row.log_tail)


def test_a_wrong_write_raises_and_the_store_carries_on(db_url: str) -> None:
    with HistoryStore.open(db_url) as store:
        run = new_run(store)
        store.record_attempt(run, record(1))
        with pytest.raises(Exception, match=r"(?i)unique|duplicate"):
            store.record_attempt(run, record(1))
        with pytest.raises(LookupError, match="no job run"):
            store.finish_job_run(str(uuid.uuid4()), JobStatus.FAILED, "?")
        with pytest.raises(ValueError):
            store.finish_job_run(run, "exploded", "?")
        store.record_attempt(run, record(2))
        assert store.pending == 0
        assert [r.attempt for r in store.attempts(job_run_id=run)] == [1, 2]


# -- a database that is down ----------------------------------------------------------------------


def test_down_at_open_buffers_then_writes_everything_in_order(
    outage: Outage, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger=STORE_LOG)
    store = HistoryStore.open(outage.url)  # must not raise
    run = new_run(store)
    for n in (1, 2, 3):
        store.record_attempt(run, record(n))
    store.record_rejections(run, 3, [(200, "bad shard")])
    store.finish_job_run(run, JobStatus.COMPLETED, "done")
    assert store.pending == 6
    assert not store.flush(timeout_s=0)

    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, warnings
    assert "unavailable" in warnings[0] and "1 record(s) buffered" in warnings[0]
    assert "training continues" in warnings[0]
    with pytest.raises(StoreUnavailable, match="SPOTRUN_DATABASE_URL") as down:
        store.attempts()
    assert "\n" not in str(down.value)

    outage.recover()
    assert store.flush(timeout_s=10)
    assert store.pending == 0
    assert [(r.attempt, r.outcome) for r in store.attempts(job_run_id=run)] == [
        (1, Outcome.PREEMPTED),
        (2, Outcome.PREEMPTED),
        (3, Outcome.PREEMPTED),
    ]
    assert [r.step for r in store.rejections(run)] == [200]
    assert store.job_runs()[0].status == JobStatus.COMPLETED
    assert any("is back: wrote 6" in r.getMessage() for r in caplog.records)
    if outage.secret:
        assert outage.secret not in caplog.text and outage.secret not in str(down.value)
        assert "***" in str(down.value)
    store.close()


def test_postgres_down_mid_run_then_back(pg_database: str, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger=STORE_LOG)
    relay = Relay(free_port()).start()
    database, schema = pg_database, new_schema(pg_database)
    try:
        store = HistoryStore.open(pg_url(database, schema, relay.port))
        run = new_run(store)
        store.record_attempt(run, record(1))
        relay.stop()
        store.record_attempt(run, record(2))  # the pooled connection is gone and nothing answers
        store.record_attempt(run, record(3))
        assert store.pending == 2
        assert len(caplog.records) == 1
        relay.start()
        store.record_attempt(run, record(4))  # the next write flushes the queue first
        assert store.pending == 0
        assert [r.attempt for r in store.attempts(job_run_id=run)] == [1, 2, 3, 4]
        store.close()
    finally:
        relay.stop()


# -- concurrent first use -------------------------------------------------------------------------


def test_concurrent_first_use_threads(db_url: str) -> None:
    n = 4
    barrier = threading.Barrier(n)
    stores: list[HistoryStore] = []
    errors: list[BaseException] = []

    def first_use() -> None:
        try:
            barrier.wait()
            store = HistoryStore.open(db_url)
            new_run(store)
            stores.append(store)
        except BaseException as e:  # collected: the assertion below reports it
            errors.append(e)

    threads = [threading.Thread(target=first_use) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert errors == []
    assert [s.pending for s in stores] == [0] * n
    assert len(stores[0].job_runs()) == n
    for s in stores:
        s.close()


def test_concurrent_first_use_processes_on_one_sqlite_file(tmp_path: Path) -> None:
    url, n = f"sqlite:///{tmp_path / 'history.db'}", 2
    code = (
        "import pathlib, sys, time\n"
        "from spotrun.tasks.history import HistoryStore\n"
        "pathlib.Path(sys.argv[1]).touch()\n"
        f"while not pathlib.Path({str(tmp_path / 'go')!r}).exists(): time.sleep(0.002)\n"
        f"s = HistoryStore.open({url!r})\n"
        "s.start_job_run('digits', 'h', None, storage_uri='file:///x', provider='local')\n"
        "sys.exit(s.pending)\n"
    )
    ready = [tmp_path / f"ready-{i}" for i in range(n)]
    procs = [
        subprocess.Popen([sys.executable, "-c", code, str(r)], stderr=subprocess.PIPE, text=True)
        for r in ready
    ]
    deadline = time.monotonic() + 30
    while not all(r.exists() for r in ready) and time.monotonic() < deadline:  # all imported: go together
        time.sleep(0.002)
    (tmp_path / "go").touch()
    errors = [p.communicate(timeout=60)[1] for p in procs]
    assert [(p.returncode, e) for p, e in zip(procs, errors, strict=True)] == [(0, "")] * n
    with HistoryStore.open(url) as store:
        assert len(store.job_runs()) == n


# -- the URL setting ------------------------------------------------------------------------------


def test_database_url_setting(tmp_path: Path) -> None:
    assert default_url(tmp_path) == f"sqlite:///{tmp_path / 'history.db'}"
    assert database_url({}, tmp_path) == default_url(tmp_path)
    assert database_url({"SPOTRUN_DATABASE_URL": " postgresql://u@h/db "}, tmp_path) == "postgresql://u@h/db"
    assert normalize_url("postgresql://u:p@h/db").drivername == "postgresql+psycopg"
    assert normalize_url("postgresql+asyncpg://u@h/db").drivername == "postgresql+psycopg"
    assert normalize_url("sqlite:///x.db").drivername == "sqlite"
    with pytest.raises(ConfigError, match="sqlite:///PATH"):
        normalize_url("not a url")
    with HistoryStore.open(default_url(tmp_path / "new" / "home")) as store:  # makes the directory
        new_run(store)
        assert store.pending == 0
    assert (tmp_path / "new" / "home" / "history.db").is_file()
