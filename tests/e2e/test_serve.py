"""`spotrun serve` keeps its worker alive: the worker child is SIGKILLed, serve restarts it, the new
worker registers and runs a training deployment run. Its own Prefect server: serve applies the alert
automations, which must not react to other modules' events. A cancelled run gives its job's slot back.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from uuid import UUID

import pytest
from prefect import get_client
from prefect.client.orchestration import SyncPrefectClient
from prefect.client.schemas.objects import State, WorkerStatus
from prefect.states import Cancelling

from spotrun.deployments.worker import POOL
from spotrun.tasks.ownership.job_slot import limit_name
from spotrun.trainer.spec.job import JobSpec
from tests.e2e.test_flow import job
from tests.e2e.test_one_run_per_job import active_slots
from tests.prefect_server import PrefectServer

ROOT = Path(__file__).parents[2]
PID = re.compile(r"worker (\S+) (?:\(pid (\d+)\) runs|restarted \(pid (\d+)\))")


class Serve:
    """`spotrun serve` as a subprocess, its output read line by line."""

    def __init__(self, env: dict[str, str]) -> None:
        cmd = [sys.executable, "-m", "spotrun.cli", "serve", "--poll", "1"]
        out, err = subprocess.PIPE, subprocess.STDOUT
        self.proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=err, text=True)
        self.lines: list[str] = []

    def until(self, pattern: re.Pattern[str]) -> re.Match[str]:
        """Read until a line matches; fails with everything read when serve exits first."""
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)
            if m := pattern.search(line):
                return m
        pytest.fail("spotrun serve exited:\n" + "".join(self.lines))

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=60)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()


@pytest.fixture
def served(tmp_path: Path) -> Iterator[tuple[Serve, PrefectServer]]:
    server = PrefectServer(tmp_path / "prefect").start()
    env = {**os.environ, **server.env(), "SPOTRUN_HOME": str(tmp_path / "home"), "PYTHONPATH": str(ROOT)}
    env.pop("SPOTRUN_DATABASE_URL", None)
    try:
        with server.clients():
            serve = Serve(env)
            try:
                yield serve, server
            finally:
                if serve.proc.poll() is None:
                    serve.stop()
    finally:
        server.stop()


def test_serve_restarts_a_killed_worker_which_then_runs_a_deployment(
    served: tuple[Serve, PrefectServer], tmp_path: Path
) -> None:
    serve, _ = served
    first = serve.until(PID)
    name, old_pid = first[1], int(first[2])
    os.kill(old_pid, signal.SIGKILL)
    died = serve.until(re.compile(r"worker \S+ exited with (-?\d+) after .* restarting in (\d+) s"))
    assert died[1] == "-9" and died[2] == "1", "".join(serve.lines)
    new_pid = int(serve.until(PID)[3])  # printed once the server has a heartbeat from the new worker
    assert new_pid != old_pid
    os.kill(new_pid, 0)  # alive
    with get_client(sync_client=True) as client:
        (worker,) = [w for w in client.read_workers_for_work_pool(POOL) if w.name == name]
        assert worker.status is WorkerStatus.ONLINE
        spec = job(tmp_path, name=f"served-{uuid.uuid4().hex[:6]}", total_steps=50, args={"hidden": 16})
        state = final_state(client, deployment_run(client, spec))
        assert state.is_completed(), state.message
        # a cancelled run gives its job's slot back as it stops, not a lease (60 s) later
        spec = job(tmp_path / "long", name=f"cancelled-{uuid.uuid4().hex[:6]}", total_steps=10**6)
        run_id = deployment_run(client, spec)
        wait_for(lambda: active_slots(limit_name(spec.name)) == 1, "the run took no slot", serve)
        client.set_flow_run_state(run_id, Cancelling(), force=True)
        state = final_state(client, run_id)
        assert state.is_cancelled(), state
        # the flow process releases it while it stops, which may end a moment after the state does:
        # well within the lease's 60 s either way
        wait_for(lambda: active_slots(limit_name(spec.name)) == 0, "the slot outlived the run", serve, 20)
    assert serve.stop() == 0, "".join(serve.lines)


def deployment_run(client: SyncPrefectClient, spec: JobSpec) -> UUID:
    dep = client.read_deployment_by_name("resilient-training/resilient-training")
    params = {"job": spec.model_dump(mode="json"), "policy": {"max_errors": 1}}
    return client.create_flow_run_from_deployment(dep.id, parameters=params).id


def wait_for(done: Callable[[], bool], what: str, serve: Serve, timeout_s: float = 180) -> None:
    """Poll until done(); the generous timeout covers the worker's poll, a flow-run subprocess, a trainer."""
    deadline = time.monotonic() + timeout_s
    while not done():
        assert time.monotonic() < deadline, f"{what}: {''.join(serve.lines)}"
        time.sleep(0.5)


def final_state(client: SyncPrefectClient, run_id: UUID) -> State:
    deadline = time.monotonic() + 180
    while not (state := client.read_flow_run(run_id).state) or not state.is_final():
        assert time.monotonic() < deadline, f"the run is still {state}"
        time.sleep(0.5)
    return state
