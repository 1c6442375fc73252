"""The control loop as plain Python: no Prefect server (the API address points at a closed port), real
trainers through the local provider, SQL history in SQLite; and adoption of a job whose controller died."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from spotrun.tasks.control.loop import PlainSink, run_job
from spotrun.tasks.decisions.policy import RetryPolicy
from spotrun.tasks.history import HistoryStore
from spotrun.tasks.history.models import JobStatus
from spotrun.tasks.ownership import adoption
from spotrun.tasks.providers.local import (
    LocalProvider,
    LocalProviderConfig,
    PlannedPreemption,
    SpotSimulatorConfig,
)
from spotrun.tasks.settings import Settings
from spotrun.trainer.checkpoint.catalog import Catalog
from spotrun.trainer.spec.job import JobSpec
from spotrun.trainer.storage import open_storage

pytestmark = pytest.mark.timeout(300)


@pytest.fixture
def no_prefect(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PREFECT_API_URL", "http://127.0.0.1:9/api")  # anything that calls Prefect fails


def _job(tmp_path: Path, **overrides: Any) -> JobSpec:
    spec: dict[str, Any] = {
        "name": "plain",
        "recipe": "digits",
        "args": {"hidden": 32},
        "total_steps": 600,
        "threads": 1,
        "seed": 3,
        "checkpoint": {"every_steps": 25, "keep": 2},
        "storage": str(tmp_path / "store"),
        "log_every": 100,
        "tracking": {"mlflow": False},  # tests/integration/test_tracking.py tracks
    }
    return JobSpec.model_validate({**spec, **overrides})


def _provider(tmp_path: Path, *plan: PlannedPreemption) -> LocalProvider:
    sim = SpotSimulatorConfig(schedule=list(plan))
    # a 2 s notice: at most 1 s of training through it (trainer/preemption/handover.py),
    # the attempts stay as planned
    return LocalProvider(LocalProviderConfig(workdir=str(tmp_path / "work"), simulator=sim, notice_s=2))


def _settings(tmp_path: Path) -> Settings:
    home = tmp_path / "home"
    return Settings(home, f"sqlite:///{home / 'history.db'}")


def test_run_job_without_a_prefect_server(tmp_path: Path, no_prefect: None) -> None:
    sink = PlainSink()
    # hooks: the worker's, through its status record, and the controller's, into the rows and events
    end = ["sh", "-c", "echo $SPOTRUN_OUTCOME at $SPOTRUN_STEP"]
    job = _job(tmp_path, hooks={"on_preempt": ["true"], "on_complete": ["false"], "on_attempt_end": end})
    settings = _settings(tmp_path)
    result = run_job(
        job,
        _provider(tmp_path, PlannedPreemption(after_s=0.2)),
        RetryPolicy(),
        sink,
        settings=settings,
        sleep=lambda s: None,
    )
    assert result.completed, result.message
    names = [name for name, _ in sink.events]
    assert names == [
        "spotrun.attempt.started",
        "spotrun.hook.ran",  # on_preempt, on the worker (the simulator's SIGTERM with its notice window)
        "spotrun.hook.ran",  # on_attempt_end
        "spotrun.attempt.preempted",
        "spotrun.job.restarted",
        "spotrun.attempt.started",
        "spotrun.hook.failed",  # on_complete exits 1: recorded, and the job completes all the same
        "spotrun.hook.ran",
        "spotrun.attempt.resume-checked",
        "spotrun.job.completed",
    ]
    store = HistoryStore.open(settings.database_url)
    runs, rows = store.job_runs("plain"), store.attempts(job="plain")
    store.close()
    assert [r.status for r in runs] == [JobStatus.COMPLETED]
    assert [r.outcome.value for r in rows] == ["preempted", "completed"]
    assert rows[1].resumed_from == rows[0].last_durable_step
    hooks = [[(h["event"], h["code"], h["output"]) for h in r.extra["hooks"]] for r in rows]
    assert hooks == [
        [("on_preempt", 0, ""), ("on_attempt_end", 0, f"preempted at {rows[0].last_step}\n")],
        [("on_complete", 1, ""), ("on_attempt_end", 0, "completed at 600\n")],
    ]
    # the replacement was started at the notice, while attempt 1 still saved (provider.prewarm)
    assert rows[1].started_at < rows[0].ended_at
    assert not (settings.job_dir("plain") / adoption.CONTROLLER_FILE).exists()  # released at the end


def test_a_new_controller_adopts_a_job_whose_controller_died(tmp_path: Path, no_prefect: None) -> None:
    """A controller SIGKILLed mid-attempt left a `running` job run, a controller file naming its dead
    process and a worker file; the next run_job continues the same job run, records the dead attempt as
    lost (controller died), lets the new trainer take the lease at once, and completes."""
    job, settings = _job(tmp_path), _settings(tmp_path)
    store = HistoryStore.open(settings.database_url)
    run_id = store.start_job_run(
        "plain", job.spec_hash(), "dead-flow-run", storage_uri=job.storage, provider="local"
    )
    store.close()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    job_dir = settings.job_dir("plain")
    ref = adoption.ProcessRef(adoption.ProcessRef.of(1).host, dead.pid, 1)
    info = adoption.ControllerInfo(run_id, "dead-flow-run", ref, time.time() - 60)
    job_dir.mkdir(parents=True)
    (job_dir / adoption.CONTROLLER_FILE).write_text(__import__("json").dumps(adoption.asdict(info)))
    worker = adoption.WorkerInfo(
        run_id,
        "dead-flow-run",
        "local-999999",
        provider="local",
        attempt=1,
        started_at=time.time() - 50,
        process=None,
    )
    (job_dir / adoption.WORKER_FILE).write_text(__import__("json").dumps(adoption.asdict(worker)))

    result = run_job(
        job,
        _provider(tmp_path),
        RetryPolicy(),
        PlainSink(),
        settings=settings,
        flow_run_id="new-flow-run",
        sleep=lambda s: None,
    )
    assert result.completed, result.message
    store = HistoryStore.open(settings.database_url)
    runs, rows = store.job_runs("plain"), store.attempts(job_run_id=run_id)
    store.close()
    assert [(r.id, r.status, r.flow_run_id, r.controller_restarts) for r in runs] == [
        (run_id, JobStatus.COMPLETED, "new-flow-run", 1)
    ]
    assert [r.outcome.value for r in rows] == ["lost", "completed"]
    assert "controller died" in rows[0].cause and rows[0].worker_id == "local-999999"
    assert rows[1].attempt == 2


def test_adaptive_interval_plans_for_the_jobs_own_reclaims(
    tmp_path: Path, no_prefect: None, caplog: pytest.LogCaptureFixture
) -> None:
    """`every: auto`: attempt 1 plans for the spec's prior; attempt 2 for the prior pulled by attempt 1's
    training, its reclaim (with notice: the emergency checkpoint kept every step) costing no work; each
    attempt's record holds the interval its trainer chose, and why."""
    caplog.set_level("INFO", logger="spotrun.control")
    job = _job(tmp_path, checkpoint={"every": "auto", "mtbf_prior_s": 600, "keep": 2})
    settings = _settings(tmp_path)
    result = run_job(
        job,
        _provider(tmp_path, PlannedPreemption(after_s=0.2)),
        RetryPolicy(),
        PlainSink(),
        settings=settings,
        sleep=lambda s: None,
    )
    assert result.completed, result.message
    store = HistoryStore.open(settings.database_url)
    rows = store.attempts(job="plain")
    store.close()
    assert [r.outcome.value for r in rows] == ["preempted", "completed"]
    first, second = (r.extra["checkpoint_interval"] for r in rows)
    assert first["mtbf_s"] == 600  # no history yet: the prior
    # attempt 1's training and no reclaim that lost work, with the prior (the replacement, started at
    # the notice, counted the training as it happened)
    assert rows[0].lost_steps == 0 and 600 <= second["mtbf_s"] <= round(rows[0].wall_s + 600) + 1
    assert "between reclaims" in second["reason"] and second["seconds"] >= 5
    planned = [r.getMessage() for r in caplog.records if "checkpoint interval planned" in r.getMessage()]
    assert "the spec's prior" in planned[0] and "lose work (0 in" in planned[1]
    assert result.summary.checkpoint_interval == second  # the flow's summary says it too


def test_ctrl_c_before_the_watch_still_gets_the_emergency_checkpoint(
    tmp_path: Path, no_prefect: None
) -> None:
    """A Ctrl-C between provisioning and the watch (a forked trainer can be at step 100 by then): the
    trainer is stopped as a watched one would be, and the attempt is recorded with what it saved."""
    job = _job(tmp_path, total_steps=100_000)
    settings = _settings(tmp_path)

    class CtrlCBeforeWatch(PlainSink):
        def step(self, name: str, fn: Any, *args: Any) -> Any:
            if name != "train":
                return fn(*args)
            catalog, deadline = Catalog(open_storage(job.storage)), time.monotonic() + 60
            while catalog.latest() is None:  # the trainer has trained, unwatched
                assert time.monotonic() < deadline, "no checkpoint from the trainer"
                time.sleep(0.05)
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run_job(job, _provider(tmp_path), RetryPolicy(), CtrlCBeforeWatch(), settings=settings)
    store = HistoryStore.open(settings.database_url)
    runs, rows = store.job_runs("plain"), store.attempts(job="plain")
    store.close()
    assert [r.status for r in runs] == [JobStatus.CANCELLED], runs
    assert [r.outcome.value for r in rows] == ["cancelled"], rows
    a = rows[0]
    assert a.last_durable_step == a.last_step > 0, a  # the emergency checkpoint at the stopping step
    assert a.lost_steps == 0 and "emergency checkpoint" in a.cause, a
    assert Catalog(open_storage(job.storage)).latest() == a.last_step
