"""How a flow that does not return ends in SQL, and when a new controller may adopt a job: tables."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from prefect.exceptions import TerminationSignal

from spotrun.tasks.decisions.attempts import Outcome
from spotrun.tasks.decisions.outcome import classify
from spotrun.tasks.history.models import JobRunRow, JobStatus
from spotrun.tasks.ownership import adoption
from spotrun.tasks.ownership.adoption import ControllerInfo, ProcessRef, controller_gone
from spotrun.tasks.ownership.endings import ending_for, ending_for_state
from spotrun.tasks.providers.base import StopCause, WatchResult, stop_cause
from spotrun.trainer.telemetry.records import Exit


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


def _row(status: JobStatus, storage: str = "/s", flow_run: str = "dead") -> JobRunRow:
    return JobRunRow(
        "jr",
        "job",
        "h",
        flow_run_id=flow_run,
        storage_uri=storage,
        provider="local",
        status=status,
        message="",
        started_at=0.0,
        ended_at=None,
    )


DEAD_HERE = ControllerInfo("jr", "dead", ProcessRef(HERE, 2**22 + 7, 1), 0.0)  # no such pid
ALIVE_HERE = ControllerInfo("jr", "dead", ProcessRef.of(os.getpid()), 0.0)
OTHER_RUN_DEAD = ControllerInfo("another-job-run", "x", ProcessRef(HERE, 2**22 + 7, 1), 0.0)


@pytest.mark.parametrize(
    ("row", "recovers", "info", "state", "adopt"),
    [
        (None, "", None, None, False),
        (_row(JobStatus.RUNNING), "", DEAD_HERE, None, True),  # its controller's process is gone
        (
            _row(JobStatus.RUNNING),
            "",
            ALIVE_HERE,
            "CRASHED",
            False,
        ),  # alive here: never, whatever Prefect says
        (_row(JobStatus.RUNNING, "/other"), "", DEAD_HERE, None, False),  # same name, other storage
        (_row(JobStatus.RUNNING), "", None, "CRASHED", True),  # another host: Prefect says it is over
        (_row(JobStatus.RUNNING), "", None, "RUNNING", False),
        (_row(JobStatus.RUNNING), "", None, None, False),  # no word from Prefect: not proof of death
        (_row(JobStatus.RUNNING), "", OTHER_RUN_DEAD, "RUNNING", False),  # a stale file of another job run
        (_row(JobStatus.CRASHED), "dead", None, None, True),  # recover-job's run, after the crashed hook
        (
            _row(JobStatus.CRASHED),
            "",
            DEAD_HERE,
            None,
            False,
        ),  # a crashed run is continued only by its recovery
        (_row(JobStatus.CRASHED), "someone-else", None, None, False),
        (_row(JobStatus.COMPLETED), "dead", None, None, False),
        (_row(JobStatus.RUNNING, flow_run="me"), "", DEAD_HERE, None, False),  # itself
    ],
)
def test_should_adopt(
    row: JobRunRow | None, recovers: str, info: ControllerInfo | None, state: str | None, adopt: bool
) -> None:
    assert (
        adoption.should_adopt(row, "/s", "me", recovers=recovers, info=info, flow_state=lambda: state)
        is adopt
    )


def test_lost_attempt_counts_steps_past_the_durable_checkpoint() -> None:
    w = adoption.WorkerInfo(
        "jr", "dead", "local-1", provider="local", attempt=3, started_at=100.0, process=None
    )
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
    from spotrun.tasks.history import HistoryStore
    from spotrun.tasks.ownership.endings import Ending, close_job_run_of

    monkeypatch.setenv("SPOTRUN_HOME", str(tmp_path))
    monkeypatch.delenv("SPOTRUN_DATABASE_URL", raising=False)
    store = HistoryStore.open(f"sqlite:///{tmp_path / 'history.db'}")
    mine = store.start_job_run("j", "h", "fr-1", storage_uri="/s", provider="local")
    other = store.start_job_run("j", "h", "fr-2", storage_uri="/s", provider="local")
    store.close()
    gave_up = Ending(JobStatus.CRASHED, "controller died; gave up after 3 restarts")
    assert close_job_run_of("j", "fr-1", gave_up) is True
    assert close_job_run_of("j", "fr-1", gave_up) is False  # already closed: left alone
    store = HistoryStore.open(f"sqlite:///{tmp_path / 'history.db'}")
    status = {r.id: (r.status, r.message) for r in store.job_runs("j")}
    store.close()
    assert status == {mine: (JobStatus.CRASHED, gave_up.message), other: (JobStatus.RUNNING, "")}


@pytest.mark.parametrize(
    ("tags", "crashed"),
    [
        (["spotrun-restart", "spotrun-job:j", "spotrun-recovers:1b4e28ba-2fa1-11d2-883f-0016d3cca427"],
         "1b4e28ba-2fa1-11d2-883f-0016d3cca427"),
        (["spotrun-heartbeat"], ""),
        ([], ""),
    ],
)  # fmt: skip  # a decision table, one case per row
def test_recovered_run_from_tags(tags: list[str], crashed: str) -> None:
    from spotrun.tasks.ownership.recovery import recovered_run

    assert recovered_run(tags) == crashed


def test_attempts_lost_with_their_controller_do_not_use_up_the_error_budget() -> None:
    import random

    from spotrun.tasks.decisions.attempts import AttemptRecord
    from spotrun.tasks.decisions.policy import RetryPolicy, decide

    def lost(n: int) -> AttemptRecord:
        return adoption.lost_attempt(None, n, "dead", last_step=10, durable_step=5, now=float(n))

    crash = AttemptRecord(
        4,
        "w",
        "local",
        started_at=0.0,
        ended_at=1.0,
        outcome=Outcome.CRASHED,
        cause="exited CRASHED: x",
        error="x",
    )
    decision = decide([lost(1), lost(2), lost(3), crash], RetryPolicy(max_errors=2), random.Random(0))
    assert decision.action == "retry", decision  # 1 error of 2: the controller deaths are not counted
