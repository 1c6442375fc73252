"""Scheduled retraining, end to end on a real Prefect server: three nightly slots of one deployment (flow
runs created with past scheduled times, run by Prefect's flow engine as a worker's flow process runs
them) are three job runs with three storage prefixes and three model versions. Nights 2 and 3
warm-start from the night before; night 2's controller is SIGKILLed mid-run and recover-job's rerun
continues night 2 (not a new run) to the same bits as an uninterrupted night 2; night 3, worse, leaves
the alias where it is; retention removes night 1's prefix."""

from __future__ import annotations

import itertools
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from datetime import datetime
from pathlib import Path
from typing import Any
from uuid import UUID

import pytest
from prefect import get_client
from prefect.client.schemas.objects import FlowRun
from prefect.flow_engine import run_flow
from prefect.states import Scheduled, State

from spotrun.cli import main
from spotrun.flows.recover_job import recover_job
from spotrun.flows.resilient_training import resilient_training
from spotrun.tasks.admission.trust import named, write_allowed
from spotrun.tasks.history import HistoryStore
from spotrun.trainer.checkpoint.format import step_dir
from tests.trainer_runs import assert_states_equal, trainer

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
NIGHTS = ["2026-12-01", "2026-12-02", "2026-12-03"]
FLOW_PROCESS = """
import sys
from uuid import UUID
from prefect.flow_engine import load_flow_run, run_flow
from spotrun.flows.resilient_training import resilient_training
run_flow(resilient_training, flow_run=load_flow_run(UUID(sys.argv[1])), return_type="state")
"""


def nightly(tmp_path: Path, name: str) -> dict[str, Any]:
    return {
        "name": name,
        "recipe": "digits",
        "run_key": "{scheduled_date}",
        "args": {"hidden": 64, "holdout": 300, "partition": "{scheduled_date}"},
        "total_steps": 1500,
        "threads": 1,
        "seed": 7,
        "checkpoint": {"every_steps": 100, "keep": 2},
        "storage": str(tmp_path / "store"),
        "log_every": 500,
        "init_from": {"job": name, "which": "latest-completed", "parts": ["model", "optimizer"]},
        "promote": {"metric": "eval_loss", "mode": "min", "alias": "champion"},
        "keep_runs": 2,
    }


def slot(deployment: UUID, night: str, **job: Any) -> FlowRun:
    """A flow run of the deployment for that night's 03:00 UTC slot (its parameters, plus `job` fields)."""
    when = datetime.fromisoformat(f"{night}T03:00:00+00:00")
    with get_client(sync_client=True) as client:
        params = client.read_deployment(deployment).parameters
        params = params | {"job": params["job"] | job} if job else params
        return client.create_flow_run_from_deployment(
            deployment, parameters=params, state=Scheduled(scheduled_time=when)
        )


def run_here(flow_run: FlowRun) -> State:
    state = run_flow(resilient_training, flow_run=flow_run, return_type="state")
    assert isinstance(state, State) and state.is_completed(), state
    return state


def kill_mid_run(flow_run: FlowRun, key_store: Path, env: dict[str, str]) -> None:
    """Run the slot in a flow process of its own and SIGKILL it once its trainer has checkpointed."""
    proc = subprocess.Popen([sys.executable, "-c", FLOW_PROCESS, str(flow_run.id)], env=env, cwd=REPO)
    try:
        deadline = time.monotonic() + 180
        while not (key_store / step_dir(300) / "manifest.json").exists():
            assert proc.poll() is None, "night 2's flow process ended before it was killed"
            assert time.monotonic() < deadline, "night 2 did not checkpoint step 300"
            time.sleep(0.05)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert not (key_store / "COMPLETED.json").exists(), "night 2 completed before its controller died"


def test_three_nights(
    prefect_api: str, home: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    name = f"nightly-{uuid.uuid4().hex[:6]}"
    store = tmp_path / "store"
    write_allowed(home, named({"job": nightly(tmp_path, name)}))  # as `spotrun deploy` writes it
    with get_client(sync_client=True) as client:
        flow_id = client.create_flow(resilient_training)
        deployment = client.create_deployment(
            flow_id,
            "nightly",
            entrypoint="spotrun.flows.resilient_training:resilient_training",
            parameters={"job": nightly(tmp_path, name)},
        )

    run_here(slot(deployment, NIGHTS[0], total_steps=300))  # night 1: a short first model
    night2 = slot(deployment, NIGHTS[1])
    kill_mid_run(night2, store / NIGHTS[1], dict(os.environ))
    recovered = recover_job(crashed_flow_run_id=str(night2.id))
    assert recovered["action"] == "restart", recovered
    with get_client(sync_client=True) as client:
        rerun = client.read_flow_run(UUID(recovered["flow_run_id"]))
    run_here(rerun)  # a new flow run, a new name and time: night 2 goes on
    # it ends where an uninterrupted night 2 (same key, same data, same warm start) ends
    resolved = home / "jobs" / name / "runs" / NIGHTS[1] / "job.yaml"
    reference = tmp_path / "reference"
    reference.mkdir()
    r = trainer(resolved, str(reference / "store"), reference)
    assert r.returncode == 0, r.stderr[-2000:]
    final = step_dir(1500)
    assert_states_equal(store / NIGHTS[1] / final, reference / "store" / final)
    # night 3: a learning rate that diverges, so its model is worse than the champion
    third = run_here(slot(deployment, NIGHTS[2], args=nightly(tmp_path, name)["args"] | {"lr": 30.0}))
    assert third.result()["promotion"]["promoted"] is False

    runs = _job_runs(home, name)
    assert [(r.run_key, r.status.value) for r in runs] == [(n, "completed") for n in NIGHTS]
    assert [r.storage_uri for r in runs] == [str(store / n) for n in NIGHTS]
    assert runs[1].controller_restarts == 1  # continued, not a new job run
    assert runs[0].lineage["loaded"]["loaded"] is False  # the first night had nothing to start from
    for before, after in itertools.pairwise(runs):  # nights 2 and 3 from the night before
        assert after.lineage["init_from"]["run_key"] == before.run_key
        assert after.lineage["loaded"]["loaded"] is True
    assert [r.run_values["scheduled_date"] for r in runs] == NIGHTS  # each night's data: its partition
    assert [r.promotion["promoted"] for r in runs] == [True, True, False]
    assert [r.promotion["version"] for r in runs] == ["1", "2", "3"]
    assert _champion(home, name) == "2"

    assert sorted(p.name for p in store.iterdir()) == NIGHTS[1:]  # keep_runs 2: night 1 deleted
    assert main(["history", name, "--run-key", NIGHTS[1], "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert {row["run_key"] for row in rows} == {NIGHTS[1]} and len(rows) == 2  # killed, then completed
    assert main(["report", name, "--run-key", NIGHTS[2]]) == 0
    assert "promotion: kept" in capsys.readouterr().out


def _job_runs(home: Path, name: str) -> list[Any]:
    store = HistoryStore.open(f"sqlite:///{home / 'history.db'}")
    try:
        return sorted(store.job_runs(name), key=lambda r: r.run_key or "")
    finally:
        store.close()


def _champion(home: Path, name: str) -> str:
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{home / 'mlflow.db'}")
    return str(client.get_model_version_by_alias(name, "champion").version)
