"""How a flow that does not return ends in SQL, and when a new controller may adopt a job: tables."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from prefect.exceptions import TerminationSignal

from tasks import adoption
from tasks.adoption import ControllerInfo, ProcessRef, controller_gone
from tasks.attempts import Outcome
from tasks.endings import ending_for, ending_for_state
from tasks.history.models import JobRunRow, JobStatus
from tasks.outcome import classify
from tasks.providers.base import StopCause, WatchResult
from tasks.providers.local import stop_cause
from trainer.records import Exit


@pytest.mark.parametrize(
    ("error", "state", "status", "words"),
    [
        (KeyboardInterrupt(), None, JobStatus.CANCELLED, "Ctrl-C"),
        (TerminationSignal(15), "CANCELLING", JobStatus.CANCELLED, "cancelled"),
        (TerminationSignal(15), "CANCELLED", JobStatus.CANCELLED, "cancelled"),
        (TerminationSignal(15), "RUNNING", JobStatus.CRASHED, "SIGTERM"),
        (TerminationSignal(15), None, JobStatus.CRASHED, "SIGTERM"),
        (RuntimeError("boom\nsecond line"), None, JobStatus.CRASHED, "RuntimeError: boom"),
    ],
)
def test_ending_for(error: BaseException, state: str | None, status: JobStatus, words: str) -> None:
    end = ending_for(error, state)
    assert end.status is status
    assert words in end.message and "\n" not in end.message


@pytest.mark.parametrize(
    ("state", "status"),
    [("CANCELLED", JobStatus.CANCELLED), ("CANCELLING", JobStatus.CANCELLED), ("CRASHED", JobStatus.CRASHED)],
)
def test_ending_for_state(state: str, status: JobStatus) -> None:
    assert ending_for_state(state, "").status is status


@pytest.mark.parametrize(
    ("error", "cause"),
    [(KeyboardInterrupt(), "interrupt"), (TerminationSignal(15), "cancel"), (ValueError("x"), "error")],
)
def test_stop_cause(error: BaseException, cause: str) -> None:
    assert stop_cause(error) == cause


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


HERE = socket.gethostname()


@pytest.mark.parametrize(
    ("where", "state", "gone"),
    [
        ("alive-here", None, False),  # our own process: never adopted, whatever Prefect says
        ("alive-here", "CRASHED", False),
        ("dead-here", None, True),  # same host, process gone: adopt at once, no need to ask Prefect
        ("dead-here", "RUNNING", True),  # a zombie Prefect still calls Running
        ("elsewhere", None, False),  # another host and no word from Prefect: not proof of death
        ("elsewhere", "RUNNING", False),
        ("elsewhere", "CANCELLING", False),
        ("elsewhere", "CRASHED", True),  # marked Crashed by the zombie automation
        ("elsewhere", "COMPLETED", True),
        ("no-file", None, False),
        ("no-file", "CRASHED", True),
    ],
)
def test_controller_gone(where: str, state: str | None, gone: bool) -> None:
    refs = {
        "alive-here": ProcessRef.of(os.getpid()),
        "dead-here": ProcessRef(HERE, _dead_pid(), 1),
        "elsewhere": ProcessRef("another-host", 1, 1),
    }
    info = ControllerInfo("jr", "fr", refs[where], 0.0) if where in refs else None
    assert controller_gone(info, state) is gone


def test_pid_reuse_is_not_the_same_process() -> None:
    me = ProcessRef.of(os.getpid())
    assert me.alive_here() is True
    assert ProcessRef(HERE, os.getpid(), (me.start_ticks or 0) + 1).alive_here() is False


def _row(status: JobStatus, storage: str = "/s") -> JobRunRow:
    return JobRunRow("jr", "job", "h", "fr", storage, "local", status, "", 0.0, None)


@pytest.mark.parametrize(
    ("row", "orphan"),
    [
        (None, False),
        (_row(JobStatus.RUNNING), True),
        (_row(JobStatus.RUNNING, "/other"), False),  # same name, other storage: another job
        (_row(JobStatus.COMPLETED), False),
        (_row(JobStatus.CANCELLED), False),
    ],
)
def test_is_orphan(row: JobRunRow | None, orphan: bool) -> None:
    assert adoption.is_orphan(row, "/s") is orphan


def test_lost_attempt_counts_steps_past_the_durable_checkpoint() -> None:
    w = adoption.WorkerInfo("jr", "dead", "local-1", "local", 3, 100.0, None)
    rec = adoption.lost_attempt(w, 3, "dead", last_step=57, durable_step=49, now=160.0)
    assert (rec.outcome, rec.lost_steps, rec.wall_s, rec.attempt) == (Outcome.LOST, 8, 60.0, 3)
    assert "controller died" in rec.cause


def test_controller_and_worker_files_round_trip(tmp_path: Path) -> None:
    adoption.write_controller(tmp_path, "jr", "fr")
    info = adoption.read_controller(tmp_path)
    assert info is not None and info.process.alive_here() is True and info.job_run_id == "jr"
    (tmp_path / adoption.WORKER_FILE).write_text("{not json")
    assert adoption.read_worker(tmp_path) is None


@pytest.mark.parametrize(
    ("stopped_by", "code", "durable", "last", "words"),
    [
        ("interrupt", "PREEMPTED", 40, 40, "interrupted (Ctrl-C); emergency checkpoint at step 40"),
        ("cancel", "PREEMPTED", 40, 40, "flow run cancelled"),
        ("cancel", None, 35, 40, "durable step 35"),
    ],
)
def test_a_stopped_worker_is_cancelled(
    stopped_by: str, code: str | None, durable: int, last: int, words: str
) -> None:
    r = WatchResult(
        started_at=0.0, ended_at=1.0, exit_code=75 if code else None, stopped_by=StopCause(stopped_by)
    )
    r.last_step, r.last_durable_step = last, durable
    if code:
        r.fold(Exit(t=0.5, name=code, code=75))
    outcome, cause = classify(r, completed=False)
    assert outcome is Outcome.CANCELLED and words in cause


def test_close_job_run_of_closes_only_a_running_run_of_that_flow_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tasks.endings import Ending, close_job_run_of
    from tasks.history import HistoryStore

    monkeypatch.setenv("SPOTRUN_HOME", str(tmp_path))
    monkeypatch.delenv("SPOTRUN_DATABASE_URL", raising=False)
    store = HistoryStore.open(f"sqlite:///{tmp_path / 'history.db'}")
    mine = store.start_job_run("j", "h", "fr-1", "/s", "local")
    other = store.start_job_run("j", "h", "fr-2", "/s", "local")
    store.close()
    gave_up = Ending(JobStatus.CRASHED, "controller died; gave up after 3 restarts")
    assert close_job_run_of("j", "fr-1", gave_up) is True
    assert close_job_run_of("j", "fr-1", gave_up) is False  # already closed: left alone
    store = HistoryStore.open(f"sqlite:///{tmp_path / 'history.db'}")
    status = {r.id: (r.status, r.message) for r in store.job_runs("j")}
    store.close()
    assert status == {mine: (JobStatus.CRASHED, gave_up.message), other: (JobStatus.RUNNING, "")}
