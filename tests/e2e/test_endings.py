"""Every ending is recorded, and a stop by the user loses no work: Ctrl-C under `spotrun run` and a
cancel of the flow run (the worker's SIGTERM to the flow process) both let the trainer take an emergency
checkpoint at the step it stopped at, record the attempt as cancelled and the job run as cancelled; the
same command then resumes and ends bitwise equal to an uninterrupted run."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from prefect import get_client
from prefect.states import Cancelling

from spotrun.console import spotrun_command
from spotrun.tasks.history import HistoryStore
from spotrun.tasks.history.models import JobStatus
from spotrun.tasks.ownership import adoption
from spotrun.tasks.providers.local import LocalProviderConfig
from spotrun.trainer.checkpoint.format import step_dir
from tests.e2e import test_flow
from tests.e2e.test_flow import FLOW_SCRIPT, job, reference_dir
from tests.trainer_runs import REPO, assert_states_equal

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]
pg_database = test_flow.pg_database  # a fresh PostgreSQL database (URL), dropped afterwards


def _history(home: Path, name: str) -> tuple[Any, list[Any]]:
    store = HistoryStore.open(f"sqlite:///{home / 'history.db'}")
    try:
        run = store.latest_job_run(name)
        assert run is not None
        return run, store.attempts(job_run_id=run.id)
    finally:
        store.close()


def _wait_for_steps(home: Path, name: str, steps: int, timeout_s: float = 180) -> None:
    """Until the job's metrics file (written by the trainer) shows `steps` steps."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for m in (home / "jobs" / name).glob("workers/*/metrics.jsonl"):
            lines = m.read_text().splitlines()
            if len(lines) >= steps:
                return
        time.sleep(0.2)
    raise AssertionError(f"the trainer of {name} did not reach step {steps}")


def _sigint_default() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _signal_masks(pid: int) -> str:
    """A process's blocked, ignored and caught signals (/proc), e.g. `SigBlk: 0000000000000002` when
    SIGINT is blocked."""
    lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    return " ".join(x.replace("\t", " ") for x in lines if x.startswith(("SigBlk", "SigIgn", "SigCgt")))


def _assert_cancelled_without_loss(home: Path, name: str, words: str) -> int:
    run, rows = _history(home, name)
    assert run.status is JobStatus.CANCELLED and words in run.message, run
    assert [r.outcome.value for r in rows] == ["cancelled"], rows
    a = rows[0]
    assert a.last_durable_step == a.last_step > 0, a  # the emergency checkpoint at the stopping step
    assert a.lost_steps == 0 and "emergency checkpoint" in a.cause, a
    return a.last_step


def test_ctrl_c_under_spotrun_run_checkpoints_records_and_resumes(
    prefect_api: str, home: Path, tmp_path: Path
) -> None:
    spec = job(tmp_path, name="ctrlc", total_steps=2000)  # Ctrl-C comes at step 400+
    path = tmp_path / "ctrlc.yaml"
    path.write_text(yaml.safe_dump(spec.model_dump(mode="json")))
    env = {**os.environ, "PREFECT_API_URL": prefect_api, "PYTHONPATH": str(REPO), "SPOTRUN_HOME": str(home)}
    cmd = [sys.executable, "-m", "spotrun.cli", "run", str(path)]
    # a terminal's foreground job takes Ctrl-C; one started by a shell with `&` inherits SIGINT ignored
    # (POSIX), and so would `spotrun run` here if this test process was started that way
    child = subprocess.Popen(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, preexec_fn=_sigint_default
    )
    try:
        # 400: well after the watch has begun (a Ctrl-C before it: tests/integration/test_control_loop.py)
        _wait_for_steps(home, "ctrlc", 400)
        masks = _signal_masks(child.pid)  # what the failure message needs if the interrupt has no effect
        child.send_signal(signal.SIGINT)  # what a terminal sends; the trainer is in its own session
        out, _ = child.communicate(timeout=120)
    finally:
        if child.poll() is None:
            child.kill()
    assert child.returncode == 130, f"{masks}; this process: {_signal_masks(os.getpid())}\n{out[-3000:]}"
    assert "Traceback" not in out and f"resume with: {spotrun_command()} run {path}" in out, out[-3000:]
    assert "Crash detected" not in out, out[-3000:]  # Prefect's view of the interrupt stays on its pages
    stopped = _assert_cancelled_without_loss(home, "ctrlc", "Ctrl-C")
    assert stopped < spec.total_steps

    again = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    _, rows = _history(home, "ctrlc")
    assert rows[0].resumed_from == stopped and rows[-1].outcome.value == "completed"
    assert_states_equal(Path(spec.storage) / step_dir(spec.total_steps), reference_dir(spec, tmp_path))


def test_cancel_stops_the_trainer_gracefully_and_is_recorded(
    prefect_api: str, home: Path, tmp_path: Path
) -> None:
    """A Prefect worker cancels a run by setting Cancelling and sending SIGTERM to the flow's process."""
    spec = job(tmp_path, name="cancelme", total_steps=100_000)
    env = {**os.environ, "PREFECT_API_URL": prefect_api, "PYTHONPATH": str(REPO)}
    flow_proc = subprocess.Popen([sys.executable, "-c", FLOW_SCRIPT, spec.model_dump_json()], env=env)
    try:
        _wait_for_steps(home, "cancelme", 100)
        run, _ = _history(home, "cancelme")
        with get_client(sync_client=True) as client:
            client.set_flow_run_state(run.flow_run_id, Cancelling(), force=True)  # type: ignore[arg-type]
        flow_proc.send_signal(signal.SIGTERM)
        flow_proc.wait(timeout=60)
    finally:
        if flow_proc.poll() is None:
            flow_proc.kill()
    _assert_cancelled_without_loss(home, "cancelme", "cancelled")
    latest = json.loads((Path(spec.storage) / "latest").read_text())
    _, rows = _history(home, "cancelme")
    assert latest["step"] == rows[0].last_step  # storage agrees: the stopping step is durable


PREEMPTING_FLOW = """
import sys
from spotrun.flows.resilient_training import resilient_training
from spotrun.tasks.providers.local import LocalProviderConfig, PlannedPreemption, SpotSimulatorConfig
from spotrun.trainer.spec.job import JobSpec
plan = [PlannedPreemption(after_s=0.3, notice=True)] * 2
spec = JobSpec.model_validate_json(sys.argv[1])
resilient_training(spec, LocalProviderConfig(simulator=SpotSimulatorConfig(schedule=plan), notice_s=2))
"""


def test_flow_killed_while_the_database_is_down_then_adopted(
    prefect_api: str, home: Path, tmp_path: Path, pg_database: str
) -> None:
    """PostgreSQL unreachable (a relay that is not listening), the flow process SIGKILLed after two
    preemptions: its rows wait in the journal. The next run replays them, adopts the job run (its
    controller is dead), records the killed attempt as lost and completes the job, bitwise."""
    from tests.integration.databases import Relay, free_port

    relay = Relay(free_port())
    url = pg_database.replace(":5432/", f":{relay.port}/")
    spec = job(tmp_path, name="dbdown", total_steps=3000)
    env = {
        **os.environ,
        "PREFECT_API_URL": prefect_api,
        "PYTHONPATH": str(REPO),
        "SPOTRUN_HOME": str(home),
        "SPOTRUN_DATABASE_URL": url,
    }
    flow_proc = subprocess.Popen([sys.executable, "-c", PREEMPTING_FLOW, spec.model_dump_json()], env=env)
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:  # the job run and both preempted attempts are journaled
            lines = [ln for j in (home / "journal").glob("*.jsonl") for ln in j.read_text().splitlines()]
            worker = adoption.read_worker(home / "jobs" / "dbdown")
            if sum('"record_attempt"' in ln for ln in lines) >= 2 and worker and worker.attempt == 3:
                break  # two preempted attempts journaled, the third training: killed mid-attempt
            time.sleep(0.1)
        else:
            raise AssertionError("the flow journaled no attempts")
        flow_proc.send_signal(signal.SIGKILL)
        flow_proc.wait(timeout=30)
    finally:
        if flow_proc.poll() is None:
            flow_proc.kill()
    relay.start()
    try:
        store = HistoryStore.open(url, journal_dir=home / "journal")  # any spotrun process replays
        runs, rows = store.job_runs("dbdown"), store.attempts(job="dbdown")
        assert store.pending == 0
        store.close()
        assert [r.status for r in runs] == [JobStatus.RUNNING]  # its controller died mid-run
        assert [r.outcome.value for r in rows][:2] == ["preempted", "preempted"]

        from tests.e2e.test_flow import run_flow

        os.environ["SPOTRUN_DATABASE_URL"] = url
        try:
            state = run_flow(spec, LocalProviderConfig())
        finally:
            del os.environ["SPOTRUN_DATABASE_URL"]
        assert state.is_completed(), state.message
        store = HistoryStore.open(url, journal_dir=home / "journal")
        runs, rows = store.job_runs("dbdown"), store.attempts(job="dbdown")
        store.close()
    finally:
        relay.stop()
    assert [(r.status, r.controller_restarts) for r in runs] == [(JobStatus.COMPLETED, 1)]
    outcomes = [r.outcome.value for r in rows]
    assert outcomes[:2] == ["preempted", "preempted"] and outcomes[-2:] == ["lost", "completed"], outcomes
    assert "controller died" in rows[-2].cause
    assert_states_equal(Path(spec.storage) / step_dir(spec.total_steps), reference_dir(spec, tmp_path))
