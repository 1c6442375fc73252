"""The resilient-training flow against a real Prefect server, with the local provider and real trainers."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

from spotrun.flows.resilient_training import resilient_training
from spotrun.tasks.decisions.policy import RetryPolicy
from spotrun.tasks.history import HistoryStore
from spotrun.tasks.providers.local import LocalProviderConfig, PlannedPreemption, SpotSimulatorConfig
from spotrun.trainer.checkpoint.format import step_dir
from spotrun.trainer.spec.job import JobSpec
from tests.fakes.fault_python import install
from tests.procs import wait_gone
from tests.trainer_runs import assert_states_equal, trainer

PG = "postgresql://postgres@127.0.0.1:5432"


def job(tmp_path: Path, **overrides: Any) -> JobSpec:
    spec: dict[str, Any] = {
        "name": "flowjob",
        "recipe": "digits",
        "args": {"hidden": 128},
        "total_steps": 900,
        "threads": 1,
        "seed": 5,
        "checkpoint": {"every_steps": 25, "keep": 3},
        "storage": str(tmp_path / "store"),
        "log_every": 100,
        # MLflow off: the flow tests test other things, and tracking cost ~40% of the controller's CPU
        # in them (import, a client, log_batch into SQLite: py-spy); tests/integration/test_tracking.py
        # and the demo run the default, tracked path
        "tracking": {"mlflow": False},
    }
    spec.update(overrides)
    return JobSpec.model_validate(spec)


def run_flow(spec: JobSpec, provider: LocalProviderConfig, policy: RetryPolicy | None = None) -> Any:
    return resilient_training(spec, provider, policy or RetryPolicy(), return_state=True)


def reference_dir(spec: JobSpec, tmp_path: Path, *, timeout: float = 120) -> Path:
    """The same job trained without interruption, by the trainer alone: its final checkpoint (the job
    file is `job.yaml` two levels up, the store one level up)."""
    work = tmp_path / "reference"
    work.mkdir()
    cfg = work / "job.yaml"
    cfg.write_text(json.dumps(spec.model_dump(mode="json")))
    r = trainer(cfg, str(work / "store"), work, timeout=timeout)
    assert r.returncode == 0, r.stderr[-2000:]
    return work / "store" / step_dir(spec.total_steps)


def attempts(home: Path, url: str | None = None) -> list[Any]:
    store = HistoryStore.open(url or f"sqlite:///{home / 'history.db'}")
    try:
        return store.attempts()
    finally:
        store.close()


def schedule(
    *entries: tuple[float, bool], notice_s: float = 2, fork_server: bool = True
) -> LocalProviderConfig:
    """Reclaims after these seconds of training, with a notice or not. A 2 s notice lets the old worker
    train through at most 1 s of it (trainer/preemption/handover.py): the attempts end as planned."""
    plan = [PlannedPreemption(after_s=s, notice=n) for s, n in entries]
    return LocalProviderConfig(
        simulator=SpotSimulatorConfig(schedule=plan),
        notice_s=notice_s,
        heartbeat_timeout_s=60,
        fork_server=fork_server,
    )


def test_preemptions_with_and_without_notice_complete_bitwise(
    prefect_api: str, home: Path, tmp_path: Path
) -> None:
    # 1 s of training in all before the last reclaim: reached before step 1,500 even at 1,000 steps/s
    spec = job(tmp_path, total_steps=1500)
    state = run_flow(spec, schedule((0.3, True), (0.3, False), (0.4, True)))
    assert state.is_completed(), state.message
    rows = attempts(home)
    assert [r.outcome.value for r in rows] == ["preempted", "preempted", "preempted", "completed"]
    assert "without notice" in rows[1].cause and "notice" in rows[0].cause
    assert rows[1].resumed_from is not None and rows[3].resumed_from is not None
    summary = state.result()
    assert summary["attempts"] == 4 and Path(summary["timeline"]).is_file()
    assert_states_equal(Path(spec.storage) / step_dir(spec.total_steps), reference_dir(spec, tmp_path))


def test_the_noticed_worker_trains_until_its_replacement_stands_by(
    prefect_api: str, home: Path, tmp_path: Path
) -> None:
    """A 20 s notice: the old trainer trains on while its replacement starts (2-6 s here as a fresh
    process; a forked one stands by within 0.5 s, too close to a stop at once to tell apart), saves once
    that one waits for the lease, and the replacement resumes from exactly that step: nothing lost,
    bitwise."""
    spec = job(tmp_path, total_steps=3000)
    state = run_flow(spec, schedule((0.3, True), notice_s=20, fork_server=False))
    assert state.is_completed(), state.message
    rows = attempts(home)
    assert [r.outcome.value for r in rows] == ["preempted", "completed"]
    old, new = rows
    assert new.resumed_from == old.last_step == old.last_durable_step and old.lost_steps == 0, rows
    # it trained on past the notice for as long as the replacement took to start (a process start and
    # `import torch` alone take over 1 s), which started beside it; without a handover the lead is ~0.2 s
    assert old.notice_lead_s is not None and old.notice_lead_s > 1.0, old
    assert new.started_at < old.ended_at, (new.started_at, old.ended_at)
    assert_states_equal(Path(spec.storage) / step_dir(spec.total_steps), reference_dir(spec, tmp_path))


def test_crash_loop_stops_at_the_error_budget(prefect_api: str, home: Path, tmp_path: Path) -> None:
    spec = job(tmp_path, total_steps=100, args={"hidden": 32, "fail_at_step": 30})
    policy = RetryPolicy(max_errors=2, same_error_limit=5, backoff_base_s=0.1, backoff_max_s=0.2)
    state = run_flow(spec, LocalProviderConfig(), policy)
    assert state.is_failed()
    assert (
        "gave up after 2 errors (budget 2)" in state.message
        and "injected failure at step 30" in state.message
    )
    assert [r.outcome.value for r in attempts(home)] == ["crashed", "crashed"]


def test_newest_checkpoint_corrupted_between_attempts(
    prefect_api: str, home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"1": {"corrupt_after": True}}))
    monkeypatch.setenv("SPOTRUN_TEST_FAULT_PLAN", str(plan))
    spec = job(tmp_path, total_steps=1000)  # 0.6 s of training must not finish it, even at 1,000 steps/s
    provider = schedule((0.6, True)).model_copy(update={"python": str(install(tmp_path))})
    state = run_flow(spec, provider)
    assert state.is_completed(), state.message
    rows = attempts(home)
    assert [r.outcome.value for r in rows] == ["preempted", "completed"]
    store = HistoryStore.open(f"sqlite:///{home / 'history.db'}")
    rejected = store.rejections(rows[0].job_run_id)
    store.close()
    # the trainer of attempt 2 reports what it passed over: the step the flow quarantined, and why
    assert len(rejected) == 1 and rejected[0].attempt == 2
    assert rejected[0].reasons == "quarantined: xxh3_128 mismatch in model.safetensors"
    assert rows[1].extra["rejected"] == [[rejected[0].step, rejected[0].reasons]]
    assert rows[1].resumed_from is not None and rows[1].resumed_from < rejected[0].step
    assert_states_equal(Path(spec.storage) / step_dir(spec.total_steps), reference_dir(spec, tmp_path))


def test_hung_worker_is_detected_as_lost_and_killed(
    prefect_api: str, home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"1": {"args": ["--inject-fault", "hang@40"]}}))
    monkeypatch.setenv("SPOTRUN_TEST_FAULT_PLAN", str(plan))
    spec = job(tmp_path, total_steps=100, args={"hidden": 32})
    provider = LocalProviderConfig(python=str(install(tmp_path)), heartbeat_timeout_s=3)
    state = run_flow(spec, provider)
    assert state.is_completed(), state.message
    rows = attempts(home)
    assert [r.outcome.value for r in rows] == ["lost", "completed"]
    assert "no heartbeat" in rows[0].cause
    pid = int(rows[0].worker_id.rsplit("-", 1)[1])
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


FLOW_SCRIPT = """
import sys
from spotrun.flows.resilient_training import resilient_training
from spotrun.tasks.providers.local import LocalProviderConfig
from spotrun.trainer.spec.job import JobSpec
spec = JobSpec.model_validate_json(sys.argv[1])
resilient_training(spec, LocalProviderConfig())
"""


def test_killed_flow_process_leaves_no_trainer_behind(prefect_api: str, home: Path, tmp_path: Path) -> None:
    """Cancelling a run ends in its process being terminated; even SIGKILL, which runs no cleanup at
    all, must take the trainer with it (parent-death signal)."""
    spec = job(tmp_path, name="orphan-check", total_steps=100_000)
    env = {**os.environ, "PREFECT_API_URL": prefect_api, "PYTHONPATH": str(Path(__file__).parents[2])}
    flow_proc = subprocess.Popen([sys.executable, "-c", FLOW_SCRIPT, spec.model_dump_json()], env=env)
    try:
        trainer_pid = _wait_for_trainer(home / "jobs" / "orphan-check", flow_proc.pid, timeout_s=120)
        os.kill(flow_proc.pid, signal.SIGKILL)
        flow_proc.wait()
        assert wait_gone(trainer_pid, 20), f"trainer {trainer_pid} outlived the flow process"
    finally:
        if flow_proc.poll() is None:
            flow_proc.kill()


def _wait_for_trainer(job_dir: Path, flow_pid: int, timeout_s: float) -> int:
    """The flow's trainer once it trains: a `python -m spotrun.trainer ... job.yaml`, or a child of the flow's
    fork server named `trainer` (its command line is the server's)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for proc in Path("/proc").iterdir():
            if not proc.name.isdigit():
                continue
            try:
                cmd = (proc / "cmdline").read_bytes().split(b"\0")
                comm = (proc / "comm").read_text().strip()
                parent = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
                grandparent = int(Path(f"/proc/{parent}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            fresh = b"trainer" in cmd and str(job_dir / "job.yaml").encode() in cmd
            forked = comm == "trainer" and grandparent == flow_pid
            if (fresh or forked) and _stepping(job_dir):
                return int(proc.name)
        time.sleep(0.2)
    raise AssertionError("no trainer process appeared")


def _stepping(job_dir: Path) -> bool:
    metrics = list(job_dir.glob("workers/*/metrics.jsonl"))
    return bool(metrics) and metrics[0].stat().st_size > 0


@pytest.fixture
def pg_database() -> Iterator[str]:
    name = f"spotrun_flow_{os.getpid()}_{int(time.time())}"
    try:
        admin = psycopg.connect(f"{PG}/test", autocommit=True, connect_timeout=3)
    except psycopg.OperationalError as e:
        pytest.skip(f"PostgreSQL not reachable on 127.0.0.1:5432: {e}")
    admin.execute(f'CREATE DATABASE "{name}"')
    try:
        yield f"{PG}/{name}"
    finally:
        admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        admin.close()


def test_history_on_postgresql(
    prefect_api: str, home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, pg_database: str
) -> None:
    monkeypatch.setenv("SPOTRUN_DATABASE_URL", pg_database)
    spec = job(tmp_path, total_steps=60, args={"hidden": 32})
    state = run_flow(spec, schedule((0.3, False)))
    assert state.is_completed(), state.message
    assert [r.outcome.value for r in attempts(home, pg_database)][-1] == "completed"


def test_database_down_does_not_stop_training(
    prefect_api: str,
    home: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    monkeypatch.setenv("SPOTRUN_DATABASE_URL", "postgresql://postgres@127.0.0.1:1/test")
    spec = job(tmp_path, total_steps=60, args={"hidden": 32})
    state = run_flow(spec, LocalProviderConfig())
    assert state.is_completed(), state.message
    assert any(
        "buffered" in r.getMessage() and "training continues" in r.getMessage() for r in caplog.records
    )


def test_recipe_that_cannot_be_built_stops_at_once_with_one_line(
    prefect_api: str, home: Path, tmp_path: Path
) -> None:
    """The flow builds no recipe; the trainer's CONFIG_ERROR stops the run (no retry), and `spotrun run`
    exits 2 with that one line."""
    spec = job(tmp_path, total_steps=50, args={"hidden": -4})
    state = run_flow(spec, LocalProviderConfig())
    assert state.is_failed() and "not retryable (CONFIG_ERROR)" in state.message
    assert "recipe 'digits' could not be built" in state.message and "ValueError" in state.message
    rows = attempts(home)
    assert [(r.outcome.value, r.trainer_code) for r in rows] == [("crashed", "CONFIG_ERROR")]
    path = tmp_path / "job.yaml"
    path.write_text(json.dumps(spec.model_dump(mode="json")))
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PREFECT_API_URL", prefect_api)
        r = subprocess.run(
            [sys.executable, "-m", "spotrun.cli", "run", str(path)],
            env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])},
            capture_output=True,
            text=True,
            timeout=300,
        )
    assert r.returncode == 2, r.stderr[-3000:]
    assert r.stderr.startswith("spotrun: error: attempt 1: recipe 'digits' could not be built"), r.stderr
    assert r.stderr.count("\n") == 1 and "Traceback" not in r.stderr
