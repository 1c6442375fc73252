"""A step that hangs forever in the first attempt: the progress watchdog kills the worker within its
calibrated step timeout, the attempt is recorded `hung`, and the job completes bitwise equal to an
uninterrupted run. A first attempt whose steps become 50 times slower: the throughput rule stops it
(its emergency checkpoint first) for a fresh worker, with no step lost, and the job completes bitwise
too. Through run_job with the local provider and real trainers (no Prefect server); both share one
uninterrupted reference run (the watchdog changes nothing the trainer computes)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from spotrun.tasks.control.loop import PlainSink, run_job
from spotrun.tasks.decisions.attempts import AttemptRecord
from spotrun.tasks.decisions.policy import RetryPolicy
from spotrun.tasks.history import HistoryStore
from spotrun.tasks.providers.base import Worker
from spotrun.tasks.providers.local import LocalProvider, LocalProviderConfig
from spotrun.tasks.reports import reporting as report
from spotrun.tasks.settings import Settings
from spotrun.trainer.checkpoint.format import step_dir
from spotrun.trainer.spec.job import JobSpec
from tests.e2e.test_flow import reference_dir
from tests.trainer_runs import assert_states_equal

STEP_FLOOR_S = 3.0  # the steps take milliseconds: the calibrated timeout is this floor


class FaultOnce(LocalProvider):
    """The local provider whose first trainer has `fault` (trainer/session/faults.py); unlike
    tests/fakes/fault_python.py, its trainers still fork from the fork server (seconds less)."""

    fault = ""

    def provision(
        self, job: JobSpec, attempt: int, spec_path: Path, extra_args: list[str], **kw: Any
    ) -> Worker:
        fault = ["--inject-fault", self.fault] if attempt == 1 else []
        return super().provision(job, attempt, spec_path, [*extra_args, *fault], **kw)


def _spec(store: Path, watchdog: dict[str, Any]) -> JobSpec:
    return JobSpec.model_validate(
        {
            "name": "hangs",
            "recipe": "digits",
            "args": {"hidden": 32},
            "total_steps": 100,
            "threads": 1,
            "seed": 5,
            "checkpoint": {"every_steps": 25, "keep": 3},
            "storage": str(store),
            "log_every": 1,  # a step record per step: 20 step times measured by step 21
            "tracking": {"mlflow": False},
            "watchdog": watchdog,
        }
    )


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    where = tmp_path_factory.mktemp("hung-reference")
    return reference_dir(_spec(where / "store", {}), where)


def _run(spec: JobSpec, fault: str, tmp_path: Path) -> tuple[list[AttemptRecord], PlainSink]:
    provider = FaultOnce(LocalProviderConfig(workdir=str(tmp_path / "work")))
    provider.fault = fault
    home = tmp_path / "home"
    settings = Settings(home, f"sqlite:///{home / 'history.db'}")
    sink = PlainSink()
    result = run_job(spec, provider, RetryPolicy(), sink, settings=settings, sleep=lambda s: None)
    assert result.completed, result.message
    store = HistoryStore.open(settings.database_url)
    rows = store.attempts(job="hangs")
    store.close()
    return rows, sink


def test_a_hung_step_is_killed_within_its_calibrated_timeout_and_the_job_completes_bitwise(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, reference: Path
) -> None:
    monkeypatch.setenv("PREFECT_API_URL", "http://127.0.0.1:9/api")  # anything that calls Prefect fails
    spec = _spec(tmp_path / "store", {"step_floor_s": STEP_FLOOR_S})
    rows, sink = _run(spec, "hang@40", tmp_path)
    assert [r.outcome.value for r in rows] == ["hung", "completed"], [r.cause for r in rows]
    hung = rows[0]
    fired = hung.extra["watchdog"]["fired"]
    assert fired["section"] == "step" and fired["step"] == 40 and fired["source"] == "attempt", fired
    assert fired["timeout_s"] == STEP_FLOOR_S and fired["silent_s"] >= STEP_FLOOR_S, fired
    step = hung.extra["watchdog"]["limits"]["step"]
    assert step["samples"] >= 20 and 0 < step["p99_s"] < STEP_FLOOR_S / 20, step  # the floor decided
    hang_to_kill = hung.ended_at - fired["silent_since"]  # last step record -> the worker seen gone
    print(f"\nhang to kill: {hang_to_kill:.2f} s (step timeout {fired['timeout_s']:g} s)")
    assert hang_to_kill < STEP_FLOOR_S + 10, hang_to_kill  # a loaded machine: no tight bound
    assert "hung: no step after step 40" in hung.cause and "worker killed" in hung.cause, hung.cause
    assert rows[1].resumed_from == 25
    with pytest.raises(ProcessLookupError):
        os.kill(int(hung.worker_id.rsplit("-", 1)[1]), 0)
    names = [name for name, _ in sink.events]
    assert report.ATTEMPT_HUNG in names and report.ATTEMPT_FAILED not in names, names
    # the second attempt was calibrated from the first one's figures in SQL
    assert rows[1].extra["watchdog"]["limits"]["startup"]["source"] == "history"
    assert_states_equal(Path(spec.storage) / step_dir(spec.total_steps), reference)


def test_a_throughput_collapse_moves_the_job_to_a_fresh_worker_with_no_step_lost(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, reference: Path
) -> None:
    monkeypatch.setenv("PREFECT_API_URL", "http://127.0.0.1:9/api")
    spec = _spec(tmp_path / "store", {"throughput": {"factor": 0.1, "window_s": 2.0}})
    rows, sink = _run(spec, "slow@40", tmp_path)  # each step from 40 on: 0.1 s more (milliseconds before)
    assert [r.outcome.value for r in rows] == ["hung", "completed"], [r.cause for r in rows]
    slow = rows[0]
    fired = slow.extra["watchdog"]["fired"]
    assert fired["section"] == "throughput" and fired["rate"] < 0.1 * fired["baseline"], fired
    assert "throughput collapse" in slow.cause and "emergency checkpoint" in slow.cause, slow.cause
    assert slow.lost_steps == 0 and rows[1].resumed_from == slow.last_step > 40
    assert report.ATTEMPT_HUNG in [name for name, _ in sink.events]
    assert_states_equal(Path(spec.storage) / step_dir(spec.total_steps), reference)
