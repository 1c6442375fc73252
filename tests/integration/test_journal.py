"""History that cannot be lost: the journal kept while the database is down, and its replay.

The signature test kills a process that wrote its history while the database was unreachable, then
brings the database back: the next `HistoryStore.open` writes every row exactly once.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import uuid
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

import pytest
from sqlalchemy import create_engine, func, select
from sqlalchemy.orm import Session

from spotrun.tasks.decisions.attempts import Outcome
from spotrun.tasks.history import AlertStatus, HistoryStore, JobStatus
from spotrun.tasks.history.engine import normalize_url
from spotrun.tasks.history.journal import FileJournal, journal_path
from spotrun.tasks.history.models import Alert, Attempt, CheckpointRejection, JobRun
from spotrun.tasks.history.ops import Op, stamp
from spotrun.tasks.settings import Settings
from tests.integration.databases import T0, Outage, new_run, record

REPO = Path(__file__).resolve().parents[2]
STORE_LOG, JOURNAL_LOG = "spotrun.tasks.history.store", "spotrun.tasks.history.journal"
AT = stamp(datetime.fromtimestamp(T0, UTC))


def counts(url: str) -> dict[str, int]:
    engine = create_engine(normalize_url(url))
    try:
        with Session(engine) as s:
            tables = (JobRun, Attempt, CheckpointRejection, Alert)
            return {t.__tablename__: int(s.scalar(select(func.count()).select_from(t)) or 0) for t in tables}
    finally:
        engine.dispose()


# -- idempotent replay, one operation at a time -----------------------------------------------------

RUN = "7d3c5a4e-0000-4000-8000-000000000001"
START = Op(
    "start_job_run",
    dict(
        id=RUN,
        job="digits",
        spec_hash="h",
        flow_run_id="flow-1",
        storage_uri="file:///x",
        provider="local",
        status="running",
        message="",
        started_at=AT,
    ),
    "start",
)
ATTEMPT = Op(
    "record_attempt",
    dict(
        job_run_id=RUN,
        job=None,  # another process wrote it: the replay looks the job up
        record=dict(
            attempt=1,
            worker_id="w",
            provider="local",
            started_at=AT,
            ended_at=AT,
            outcome="preempted",
            cause="spot notice",
            exit_code=None,
            signal=15,
            trainer_code=None,
            error="",
            log_tail="",
            resumed_from=None,
            resumed_checkpoint=None,
            last_step=10,
            last_durable_step=None,
            lost_steps=10,
            notice_lead_s=None,
            wall_s=1.0,
            productive_s=0.0,
            extra={},
        ),
    ),
    "attempt",
)
REJECTED = [[5, "bad"], [4, "worse"]]
REJECT = Op("record_rejections", dict(job_run_id=RUN, attempt=1, rows=REJECTED, created_at=AT), "rej")
FINISH = Op("finish_job_run", dict(job_run_id=RUN, status="completed", message="done", ended_at=AT), "end")
ADOPT = Op("adopt_job_run", dict(job_run_id=RUN, flow_run_id="flow-2"), "adopt")
ALERT = Op(
    "record_alert",
    dict(
        dedup_key="k",
        kind="gave-up",
        job="digits",
        job_run_id=RUN,
        status="sent",
        channel="log",
        http_status=None,
        error="",
        message="m",
        trigger="",
        created_at=AT,
    ),
    "alert",
)


def _run_row(url: str) -> tuple[str, str | None, int]:
    engine = create_engine(normalize_url(url))
    try:
        with Session(engine) as s:
            r = s.get(JobRun, RUN)
            assert r is not None
            return r.status, r.flow_run_id, r.controller_restarts
    finally:
        engine.dispose()


@pytest.mark.parametrize(
    ("op", "expect"),
    [
        (START, {"job_runs": 1}),
        (ATTEMPT, {"attempts": 1}),
        (REJECT, {"checkpoint_rejections": 2}),
        (FINISH, {}),
        (ADOPT, {}),
        (ALERT, {"alerts": 1}),
    ],
    ids=lambda v: v.name if isinstance(v, Op) else "",
)
def test_each_operation_replayed_twice_writes_once(db_url: str, op: Op, expect: dict[str, int]) -> None:
    with HistoryStore.open(db_url) as store:
        before = counts(db_url)
        if op is not START:
            store._apply(START, replay=False)
            before = counts(db_url)
        for _ in range(2):
            store._apply(op, replay=True)
    after = counts(db_url)
    assert {k: after[k] - before[k] for k in after if after[k] != before[k]} == expect
    if op is FINISH:
        assert _run_row(db_url)[0] == "completed"
    if op is ADOPT:
        assert _run_row(db_url) == ("running", "flow-2", 1)


def test_a_first_try_is_not_a_replay(db_url: str) -> None:
    """Live writes keep their checks: a duplicate attempt raises; each adoption counts."""
    with HistoryStore.open(db_url) as store:
        store._apply(START, replay=False)
        store._apply(ATTEMPT, replay=False)
        with pytest.raises(Exception, match=r"(?i)unique|duplicate"):
            store._apply(ATTEMPT, replay=False)
        store._apply(ADOPT, replay=False)
        store._apply(ADOPT, replay=False)
    assert _run_row(db_url)[2] == 2


def test_op_lines_round_trip_and_reject_strangers() -> None:
    for op in (START, ATTEMPT, REJECT, FINISH, ADOPT, ALERT):
        assert Op.from_json(op.to_json()) == op
    for bad in ('{"op":"drop_table","args":{}}', "[1]", '{"op":"finish_job_run"}', '{"op":"finish_jo'):
        with pytest.raises(ValueError):
            Op.from_json(bad)


# -- the journal file -------------------------------------------------------------------------------


def collect(into: list[Op]) -> Callable[[Op], bool]:
    def apply(op: Op) -> bool:
        into.append(op)
        return True

    return apply


def test_journal_skips_a_cut_line_and_the_next_append_starts_fresh(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    journal = FileJournal(tmp_path / "j.jsonl")
    journal.append(START)
    with open(journal.path, "ab") as f:  # a process killed in the middle of an append
        f.write(FINISH.to_json().encode()[:25])
    journal.append(ALERT)
    assert len(journal) == 2
    assert "skipped line 2" in caplog.text
    seen: list[Op] = []
    assert journal.replay(collect(seen))
    assert seen == [START, ALERT]
    assert journal.path.stat().st_size == 0 and len(journal) == 0


def test_journal_replay_stops_and_keeps_the_rest_in_order(tmp_path: Path) -> None:
    journal = FileJournal(tmp_path / "j.jsonl")
    for op in (START, ATTEMPT, FINISH):
        journal.append(op)
    assert not journal.replay(lambda op: op != ATTEMPT)  # "down" at the attempt
    kept: list[Op] = []
    assert journal.replay(collect(kept))
    assert kept == [ATTEMPT, FINISH]


def test_two_writers_share_a_journal_without_tearing_lines(tmp_path: Path) -> None:
    """Each writer has its own FileJournal (its own lock descriptor), as two processes would."""
    path, n = tmp_path / "j.jsonl", 40
    ops = [[Op("finish_job_run", FINISH.args | {"message": f"{w}{i}"}, "e") for i in range(n)] for w in "ab"]

    def write(batch: list[Op]) -> None:
        journal = FileJournal(path)
        for op in batch:
            journal.append(op)

    threads = [threading.Thread(target=write, args=(b,)) for b in ops]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    seen: list[Op] = []
    assert FileJournal(path).replay(collect(seen))
    for batch in ops:  # every write whole, and each writer's in its own order
        assert [op for op in seen if op in batch] == batch
    assert len(seen) == 2 * n


def test_journal_is_per_database_under_the_settings_home(tmp_path: Path) -> None:
    settings = Settings.from_env({"SPOTRUN_HOME": str(tmp_path)})
    assert settings.journal_dir == tmp_path / "journal"
    a = journal_path(settings.journal_dir, "postgresql+psycopg://u:***@h/a")
    b = journal_path(settings.journal_dir, "postgresql+psycopg://u:***@h/b")
    assert a != b and a.parent == b.parent == tmp_path / "journal" and a.suffix == ".jsonl"


# -- a process killed while the database is down ----------------------------------------------------

CHILD = """
import sys, time
from datetime import UTC, datetime
from pathlib import Path
from spotrun.tasks.decisions.attempts import AttemptRecord, Outcome
from spotrun.tasks.history import HistoryStore, JobStatus

url, journal_dir = sys.argv[1], Path(sys.argv[2])
store = HistoryStore.open(url, journal_dir=journal_dir, connect_timeout_s=2)
run = store.start_job_run(
    "digits", "sha256:abc", "flow-run-1", storage_uri="file:///tmp/ckpt", provider="local"
)
for n in (1, 2, 3):
    outcome = Outcome.COMPLETED if n == 3 else Outcome.PREEMPTED
    store.record_attempt(run, AttemptRecord(
        n, f"w{n}", "local", started_at=100.0 * n, ended_at=100.0 * n + 50, outcome=outcome, cause="c"
    ))
store.record_rejections(run, 2, [(200, "bad shard")])
store.record_alert(dedup_key="k", kind="gave-up", job="digits", status="logged", channel="log",
                   created_at=datetime.fromtimestamp(1_700_000_000, UTC))
store.finish_job_run(run, JobStatus.COMPLETED, "done")
print(run, store.pending, flush=True)
time.sleep(600)
"""


def run_and_kill(url: str, journal_dir: Path) -> tuple[str, int]:
    """Run CHILD against `url` until it has written everything, then SIGKILL it: (job run id, pending)."""
    p = subprocess.Popen(
        [sys.executable, "-c", CHILD, url, str(journal_dir)],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert p.stdout is not None
        line = p.stdout.readline()
    finally:
        os.kill(p.pid, signal.SIGKILL)
        _, err = p.communicate(timeout=30)
    assert p.returncode == -signal.SIGKILL
    assert line, err
    run, pending = line.split()
    return run, int(pending)


def test_killed_while_down_then_replayed_exactly_once(
    outage: Outage, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    journal_dir = tmp_path / "journal"
    run, pending = run_and_kill(outage.url, journal_dir)
    assert pending == 7
    (path,) = journal_dir.glob("*.jsonl")
    with open(path, "ab") as f:  # and a write cut short by the kill
        f.write(b'{"op":"record_attempt","args":{"job_run_id"')
    lines = path.read_bytes()
    if outage.secret:
        assert outage.secret.encode() not in lines

    outage.recover()
    caplog.set_level(logging.INFO)
    for replay in range(2):  # the second time as if the first had crashed before truncating
        with HistoryStore.open(outage.url, journal_dir=journal_dir) as store:
            assert store.pending == 0 and path.stat().st_size == 0
            assert [(r.attempt, r.outcome) for r in store.attempts(job_run_id=run)] == [
                (1, Outcome.PREEMPTED),
                (2, Outcome.PREEMPTED),
                (3, Outcome.COMPLETED),
            ]
            (jr,) = store.job_runs()
            assert (jr.id, jr.status, jr.message) == (run, JobStatus.COMPLETED, "done")
            assert [(r.attempt, r.step) for r in store.rejections(run)] == [(2, 200)]
            assert [a.status for a in store.alerts()] == [AlertStatus.LOGGED]
        assert counts(outage.url) == {"job_runs": 1, "attempts": 3, "checkpoint_rejections": 1, "alerts": 1}
        if replay == 0:
            assert "skipped line 8" in caplog.text
            assert "is back: wrote 7" in caplog.text
            path.write_bytes(lines)


def test_close_while_down_says_where_the_writes_are_kept(
    outage: Outage, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger=STORE_LOG)
    store = HistoryStore.open(outage.url, journal_dir=tmp_path, connect_timeout_s=2)
    new_run(store)
    assert store.journal.startswith(str(tmp_path)) and store.pending == 1
    store.close()
    (down, closing) = [r.getMessage() for r in caplog.records]
    assert f"buffered in the journal {store.journal}" in down
    assert f"1 record(s) kept in the journal {store.journal}" in closing and "replayed" in closing
    assert "lost" not in closing


# -- adoption -----------------------------------------------------------------------------------------


def test_adopting_the_job_run_of_a_dead_controller(db_url: str) -> None:
    with HistoryStore.open(db_url) as store:
        assert store.open_job_run("digits") is None
        done = new_run(store)
        store.finish_job_run(done, JobStatus.FAILED, "gave up")
        assert store.open_job_run("digits") is None
        orphan = new_run(store)  # its controller died: no ending was recorded
        store.record_attempt(orphan, record(1))
        store.record_attempt(orphan, record(2))
        found = store.open_job_run("digits")
        assert found is not None and found.id == orphan and found.controller_restarts == 0
        assert store.next_attempt(orphan) == 3 and store.next_attempt(done) == 1

        store.adopt_job_run(orphan, "flow-run-2")
        adopted = store.open_job_run("digits")
        assert adopted is not None
        assert (adopted.flow_run_id, adopted.controller_restarts, adopted.status) == (
            "flow-run-2",
            1,
            JobStatus.RUNNING,
        )
        with pytest.raises(LookupError, match="no job run"):
            store.adopt_job_run(str(uuid.uuid4()), "flow-run-3")
        store.finish_job_run(orphan, JobStatus.CRASHED, "controller died; recovery gave up")
        assert store.open_job_run("digits") is None
        assert store.job_runs()[-1].status is JobStatus.CRASHED


def test_a_journal_that_cannot_be_written_falls_back_to_memory(
    outage: Outage, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    blocked = tmp_path / "not-a-dir"
    blocked.write_text("")  # the journal directory cannot be made
    store = HistoryStore.open(outage.url, journal_dir=blocked, connect_timeout_s=2)
    run = new_run(store)
    store.record_attempt(run, record(1))
    assert store.pending == 2 and store.journal == "memory"
    assert "cannot be written" in caplog.text
    outage.recover()
    assert store.flush(timeout_s=10)
    assert [r.attempt for r in store.attempts(job_run_id=run)] == [1]
    store.close()


def test_a_hung_journal_holder_never_blocks_forever(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Another process stopped while it holds the journal's lock: the append gives up after the bounded
    wait, naming the holder, and the history store keeps the record in memory instead."""
    import fcntl

    from spotrun.tasks.history import journal as journal_module
    from spotrun.trainer.storage.locks import LockTimeout

    monkeypatch.setattr(journal_module, "LOCK_WAIT_S", 0.2)
    journal = FileJournal(tmp_path / "j.jsonl")
    journal.append(START)
    held = os.open(journal.path.with_name("j.jsonl.lock"), os.O_RDWR)
    fcntl.flock(held, fcntl.LOCK_EX)  # a second open file description: as another process's lock
    try:
        with pytest.raises(LockTimeout, match="history journal"):
            journal.append(ALERT)
    finally:
        os.close(held)
    journal.append(ALERT)
    assert len(journal) == 2
