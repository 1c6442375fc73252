"""Host loss, end to end: `spotrun serve`, its worker, the flow run and the trainer SIGKILLed together
while a deployment run trains. Nothing is left to say the run died, so the zombie automation (no
heartbeat for the window) marks it Crashed, the crashed automation runs recover-job, which runs the
deployment again with the same parameters on the `spotrun serve` started afterwards; that run resumes
the job and ends with the same parameters and optimizer state as an uninterrupted run.

Its own Prefect server: the automations watch every training run on the server they are applied to.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prefect import get_client
from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterId
from prefect.client.schemas.objects import FlowRun
from prefect.deployments import run_deployment
from prefect.events.filters import EventFilter, EventNameFilter

from spotrun.tasks.history import HistoryStore
from spotrun.tasks.ownership.recovery import JOB_CRASHED, RESTART_TAG, job_tag
from spotrun.trainer.checkpoint.format import MANIFEST, step_dir
from tests.e2e.test_flow import job, reference_dir
from tests.prefect_server import PrefectServer
from tests.procs import descendants
from tests.trainer_runs import assert_states_equal

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
TRAINING = "resilient-training/resilient-training"
ZOMBIE_AFTER_S = 60  # the smallest window allowed: two 30 s heartbeats
PATIENCE_S = 180  # kill -> Crashed is at most ~30 + 60 + 5 s; generous for 2 busy cores


class Serve:
    """`spotrun serve` in its own session, killed with everything under it, as a lost host."""

    def __init__(self, env: dict[str, str], log: Path) -> None:
        cmd = [
            sys.executable,
            "-m",
            "spotrun.cli",
            "serve",
            "--poll",
            "1",
            "--zombie-after",
            f"{ZOMBIE_AFTER_S}s",
        ]
        self.log = log
        with open(log, "ab") as out:
            self.proc = subprocess.Popen(
                cmd, env=env, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )

    def wait_ready(self, timeout_s: float = 180) -> None:
        deadline = time.monotonic() + timeout_s
        while "Ctrl-C stops it" not in self.log.read_text(errors="replace"):
            assert self.proc.poll() is None, self.log.read_text(errors="replace")[-3000:]
            assert time.monotonic() < deadline, "spotrun serve did not start its worker"
            time.sleep(0.5)

    def lose_host(self) -> int:
        """Stop every process under serve first (none can react to another's death), then SIGKILL."""
        tree = [*descendants(self.proc.pid), self.proc.pid]
        for sig in (signal.SIGSTOP, signal.SIGKILL):
            for pid in tree:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, sig)
        self.proc.wait(timeout=30)
        return len(tree)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                for pid in [*descendants(self.proc.pid), self.proc.pid]:
                    os.kill(pid, signal.SIGKILL)


def wait_for(what: str, probe: Any, timeout_s: float = PATIENCE_S) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        got = probe()
        if got:
            return got
        assert time.monotonic() < deadline, f"{what} within {timeout_s:.0f} s"
        time.sleep(1)


@pytest.fixture
def server(tmp_path: Path) -> Iterator[PrefectServer]:
    server = PrefectServer(tmp_path / "prefect").start()
    try:
        with server.clients():
            yield server
    finally:
        server.stop()


def training_runs(deployment_id: uuid.UUID) -> list[FlowRun]:
    with get_client(sync_client=True) as client:
        only = DeploymentFilter(id=DeploymentFilterId(any_=[deployment_id]))
        return client.read_flow_runs(deployment_filter=only)


def test_host_loss_is_detected_and_the_job_resumes_by_itself(server: PrefectServer, tmp_path: Path) -> None:
    spec = job(
        tmp_path,
        name=f"hostloss-{uuid.uuid4().hex[:6]}",
        total_steps=2500,
        args={"hidden": 64},
        checkpoint={"every_steps": 100, "keep": 3},
    )
    store = Path(spec.storage)
    env = {
        **os.environ,
        **server.env(),
        "SPOTRUN_HOME": str(tmp_path / "home"),
        "PYTHONPATH": str(REPO),
        "PYTHONUNBUFFERED": "1",
    }
    env.pop("SPOTRUN_DATABASE_URL", None)
    first = Serve(env, tmp_path / "serve-1.log")
    second: Serve | None = None
    try:
        first.wait_ready()
        params = {"job": spec.model_dump(mode="json")}
        run = run_deployment(TRAINING, parameters=params, timeout=0, as_subflow=False)
        assert isinstance(run, FlowRun) and run.deployment_id is not None

        # training, with a durable checkpoint behind it: the restart has something to resume from
        def checkpointed() -> bool:
            with get_client(sync_client=True) as client:
                now = client.read_flow_run(run.id).state
            assert now is None or not now.is_final(), f"the run ended before the kill: {now}"
            return any(store.glob(f"step_*/{MANIFEST}"))  # written last: the checkpoint is complete

        wait_for("a first checkpoint", checkpointed, 120)
        killed = first.lose_host()
        assert killed >= 4, "serve, the worker, the flow run and the trainer should all have died"
        assert not (store / step_dir(spec.total_steps)).exists(), "training ended before the kill"
        second = Serve(env, tmp_path / "serve-2.log")
        second.wait_ready()

        def crashed() -> Any:
            with get_client(sync_client=True) as client:
                state = client.read_flow_run(run.id).state
            return state if state is not None and state.is_crashed() else None

        state = wait_for("the silent run marked Crashed", crashed)
        assert "no heartbeat" in (state.message or ""), state.message

        def restarted() -> list[FlowRun]:
            return [r for r in training_runs(run.deployment_id) if r.id != run.id]

        (again,) = wait_for("a restarted run", restarted)
        assert {RESTART_TAG, job_tag(spec.name)} <= set(again.tags)
        assert again.parameters["job"] == params["job"]
        done = wait_for(
            "the restarted run to finish",
            lambda: [r for r in restarted() if r.state is not None and r.state.is_final()],
        )
        assert done[0].state is not None and done[0].state.is_completed(), done[0].state
        with get_client(sync_client=True) as client:
            named = EventFilter(event=EventNameFilter(name=[JOB_CRASHED]))
            crash_events = client.read_events(named, limit=50).events  # the server's maximum
        mine = [e for e in crash_events if e.resource.id == f"spotrun.job.{spec.name}"]
        assert mine and mine[0].payload["crashed_flow_run_id"] == str(run.id)
        assert mine[0].payload["action"] == "restart"
    finally:
        for s in (second, first):
            if s is not None:
                s.stop()
    # resumed, not retrained: the adopted run started from the checkpoint the dead one made
    after = (tmp_path / "home" / "worker.log").read_text().split("adopting job run", 1)
    assert len(after) == 2 and "starting from scratch" not in after[1], after[-1][-3000:]
    history = HistoryStore.open(f"sqlite:///{tmp_path / 'home' / 'history.db'}")
    runs, rows = history.job_runs(spec.name), history.attempts(job=spec.name)
    history.close()
    assert [(r.status.value, r.controller_restarts) for r in runs] == [
        ("completed", 1)
    ]  # one job run, continued
    assert [r.outcome.value for r in rows] == ["lost", "completed"] and "controller died" in rows[0].cause
    assert_states_equal(store / step_dir(spec.total_steps), reference_dir(spec, tmp_path))
