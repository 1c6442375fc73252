"""The control loop's decisions, end to end in milliseconds: scripted attempts (no processes, no Prefect
server), real SQL history in SQLite."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest

from spotrun.tasks.control.loop import PlainSink, run_job
from spotrun.tasks.decisions.policy import RetryPolicy
from spotrun.tasks.history import HistoryStore
from spotrun.tasks.history.models import JobStatus
from spotrun.tasks.settings import Settings
from spotrun.trainer.exitcodes import ExitCode
from spotrun.trainer.spec.job import JobSpec
from tests.fakes.provider import Ending, FakeAttempt, FakeProvider


def _job(tmp_path: Path) -> JobSpec:
    return JobSpec.model_validate(
        {
            "name": "scripted",
            "recipe": "digits",
            "total_steps": 100,
            "storage": str(tmp_path / "store"),
            "checkpoint": {"every_steps": 10, "keep": 2},
        }
    )


def _history(settings: Settings) -> tuple[list[Any], list[Any]]:
    store = HistoryStore.open(settings.database_url)
    try:
        return store.job_runs("scripted"), store.attempts(job="scripted")
    finally:
        store.close()


@pytest.fixture
def settings(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Settings:
    monkeypatch.setenv("PREFECT_API_URL", "http://127.0.0.1:9/api")  # nothing may call Prefect
    return Settings(tmp_path / "home", f"sqlite:///{tmp_path / 'history.db'}")


def test_preempted_lost_and_crashed_attempts_then_completed(tmp_path: Path, settings: Settings) -> None:
    script = [
        FakeAttempt(until=30, ending=Ending.NOTICE),
        FakeAttempt(until=45, ending=Ending.LOST),
        FakeAttempt(until=50, exit_code=ExitCode.CRASHED, error="RuntimeError: flaky"),
        FakeAttempt(),
    ]
    sink = PlainSink()
    result = run_job(
        _job(tmp_path),
        FakeProvider(script, checkpoint_every=10),
        RetryPolicy(),
        sink,
        settings=settings,
        sleep=lambda s: None,
    )
    assert result.completed, result.message
    runs, rows = _history(settings)
    assert [r.status for r in runs] == [JobStatus.COMPLETED]
    assert [r.outcome.value for r in rows] == ["preempted", "lost", "crashed", "completed"]
    assert [name for name, _ in sink.events].count("spotrun.job.restarted") == 3


def test_the_same_error_twice_gives_up_with_one_line(tmp_path: Path, settings: Settings) -> None:
    crash = FakeAttempt(until=20, exit_code=ExitCode.CRASHED, error="RuntimeError: bad batch at step 20")
    policy = RetryPolicy(same_error_limit=2)
    result = run_job(
        _job(tmp_path),
        FakeProvider([crash, crash]),
        policy,
        PlainSink(),
        settings=settings,
        sleep=lambda s: None,
    )
    assert not result.completed and "same error at step 20 twice" in result.message
    runs, _ = _history(settings)
    assert [(r.status, r.message) for r in runs] == [(JobStatus.FAILED, result.message)]


class CtrlC(PlainSink):
    """A sink whose progress report is where Ctrl-C lands (any line of the loop could be)."""

    def progress(self, job: str, step: int, total: int) -> None:
        raise KeyboardInterrupt


def test_ctrl_c_records_the_attempt_and_the_job_run_as_cancelled(tmp_path: Path, settings: Settings) -> None:
    with pytest.raises(KeyboardInterrupt):
        run_job(_job(tmp_path), FakeProvider([FakeAttempt()]), RetryPolicy(), CtrlC(), settings=settings)
    runs, rows = _history(settings)
    assert [r.status for r in runs] == [JobStatus.CANCELLED] and "Ctrl-C" in runs[0].message
    assert [r.outcome.value for r in rows] == ["cancelled"]
    assert rows[0].lost_steps == 0 and rows[0].last_durable_step == rows[0].last_step


def test_a_bug_in_the_loop_is_recorded_as_crashed(
    tmp_path: Path, settings: Settings, caplog: pytest.LogCaptureFixture
) -> None:
    class Broken(PlainSink):
        def event(self, name: str, job: str, payload: dict[str, Any], labels: Any = None) -> None:
            if name == "spotrun.job.restarted":
                raise ValueError("a bug")

    with pytest.raises(ValueError), caplog.at_level(logging.WARNING):
        run_job(
            _job(tmp_path),
            FakeProvider([FakeAttempt(until=30, ending=Ending.NOTICE), FakeAttempt()]),
            RetryPolicy(),
            Broken(),
            settings=settings,
            sleep=lambda s: None,
        )
    runs, rows = _history(settings)
    assert [(r.status, r.message) for r in runs] == [
        (JobStatus.CRASHED, "the controller failed: ValueError: a bug")
    ]
    assert [r.outcome.value for r in rows] == ["preempted"]
