"""A step that hangs forever in the first attempt: the progress watchdog kills the worker within its
calibrated step timeout, the attempt is recorded `hung`, and the job completes bitwise equal to an
uninterrupted run. Through run_job with the local provider and real trainers (no Prefect server)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from tasks.control.loop import PlainSink, run_job
from tasks.decisions.policy import RetryPolicy
from tasks.history import HistoryStore
from tasks.providers.base import Worker
from tasks.providers.local import LocalProvider, LocalProviderConfig
from tasks.reports import reporting as report
from tasks.settings import Settings
from tests.e2e.test_flow import reference_dir
from tests.trainer_runs import assert_states_equal
from trainer.checkpoint.format import step_dir
from trainer.spec.job import JobSpec

STEP_FLOOR_S = 3.0  # the steps take milliseconds: the calibrated timeout is this floor


class HangsOnce(LocalProvider):
    """The local provider whose first trainer hangs forever after step 40 (trainer/session/faults.py);
    unlike tests/fakes/fault_python.py, its trainers still fork from the fork server (seconds less)."""

    def provision(
        self, job: JobSpec, attempt: int, spec_path: Path, extra_args: list[str], **kw: Any
    ) -> Worker:
        fault = ["--inject-fault", "hang@40"] if attempt == 1 else []
        return super().provision(job, attempt, spec_path, [*extra_args, *fault], **kw)


def test_a_hung_step_is_killed_within_its_calibrated_timeout_and_the_job_completes_bitwise(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PREFECT_API_URL", "http://127.0.0.1:9/api")  # anything that calls Prefect fails
    spec = JobSpec.model_validate(
        {
            "name": "hangs",
            "recipe": "digits",
            "args": {"hidden": 32},
            "total_steps": 100,
            "threads": 1,
            "seed": 5,
            "checkpoint": {"every_steps": 25, "keep": 3},
            "storage": str(tmp_path / "store"),
            "log_every": 1,  # a step record per step: 20 step times measured by step 21
            "tracking": {"mlflow": False},
            "watchdog": {"step_floor_s": STEP_FLOOR_S},
        }
    )
    reference = reference_dir(spec, tmp_path)
    cfg = LocalProviderConfig(workdir=str(tmp_path / "work"))
    home = tmp_path / "home"
    settings = Settings(home, f"sqlite:///{home / 'history.db'}")
    sink = PlainSink()
    result = run_job(spec, HangsOnce(cfg), RetryPolicy(), sink, settings=settings, sleep=lambda s: None)
    assert result.completed, result.message

    store = HistoryStore.open(settings.database_url)
    rows = store.attempts(job="hangs")
    store.close()
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
