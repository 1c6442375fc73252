"""The Prefect server on PostgreSQL (a team's setup: docs/operations.md), end to end: a training flow
with two reclaims completes against it, and meanwhile the zombie automation marks a training run whose
controller was SIGKILLed Crashed.

The flow is the controller's (`run_job`, the Prefect sink, the job's slot, SQL history) over the fake
provider (tests/fakes/fake_flow.py): what meets the database is the controller; trainers would add
~20 s of torch imports and steps to this test and nothing the database sees.

The server gets a database of its own, copied from a migrated template (tests/prefect_postgres.py),
so runs of this test never meet. The zombie window here is 10 s (the floor of Prefect's proactive
triggers), below the product's (two 30 s heartbeats, deployments/automations.py RecoveryRules), so
the test waits seconds, not minutes: only the killed run carries the heartbeat tag the automation
watches; the training flow, called directly, does not. The 60 s window at 1-50 concurrent jobs is
bench/scale.py's measurement.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from prefect import get_client

from spotrun.deployments.automations import ZOMBIE, RecoveryRules, build_recovery_automations
from spotrun.server import flush_to_api
from tests.e2e.test_flow import attempts, job
from tests.fakes.fake_flow import fake_training
from tests.prefect_postgres import fresh_database, seed_memo, unreachable
from tests.prefect_server import PrefectServer

REPO = Path(__file__).resolve().parents[2]
ZOMBIE_AFTER_S = 10.0  # Prefect's floor for a proactive trigger
PATIENCE_S = 90  # kill -> Crashed is ~10 s + up to 5 s of the proactive trigger's cadence; 2 busy cores


@pytest.fixture
def pg_server(tmp_path: Path) -> Iterator[PrefectServer]:
    why = unreachable()
    if why:
        pytest.skip(why)
    with fresh_database("spotrun_prefect_e2e") as url:
        seed_memo(tmp_path / "prefect")
        server = PrefectServer(tmp_path / "prefect", database=url).start()
        # Prefect keeps one events worker and one log worker per process, whatever the API URL: stop
        # those of a server an earlier test used, or this test's events would go there
        flush_to_api()
        try:
            with server.clients():
                try:
                    yield server
                finally:
                    flush_to_api()  # the flow's last logs and events, before their server goes
        finally:
            server.stop()


def apply_zombie_automation(window_s: float) -> None:
    # model_construct: the product refuses a window under two heartbeats; here no run beats twice
    rules = RecoveryRules.model_construct(
        controller_restarts=0, restart_window_s=3600, zombie_after_s=window_s
    )
    (zombie,) = [a for a in build_recovery_automations(rules, uuid.uuid4()) if a.name == ZOMBIE]
    with get_client(sync_client=True) as client:
        client.create_automation(zombie)


def silent_run(server: PrefectServer, log: Path) -> tuple[subprocess.Popen[bytes], uuid.UUID]:
    """A training run that beats once and waits, in its own process; (process, flow run id)."""
    env = {**os.environ, **server.client_env(), "PYTHONPATH": str(REPO)}
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "tests.fakes.silent_flow", "600"],
            env=env,
            cwd=REPO,
            stdout=out,
            stderr=out,
        )
    deadline = time.monotonic() + 60
    while "flow-run " not in log.read_text():
        assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-2000:]
        time.sleep(0.2)
    line = next(x for x in log.read_text().splitlines() if x.startswith("flow-run "))
    return proc, uuid.UUID(line.split()[1])


def test_reclaims_and_the_zombie_automation_on_a_postgresql_server(
    pg_server: PrefectServer, home: Path, tmp_path: Path
) -> None:
    assert pg_server.database is not None and pg_server.database.startswith("postgresql+asyncpg://")
    apply_zombie_automation(ZOMBIE_AFTER_S)
    victim, victim_id = silent_run(pg_server, tmp_path / "silent.log")
    time.sleep(1)  # its first heartbeat (sent as the run starts) reaches the server
    victim.send_signal(signal.SIGKILL)
    victim.wait()
    killed_at = time.monotonic()

    spec = job(tmp_path, total_steps=90, checkpoint={"every_steps": 10, "keep": 3})
    state = fake_training(spec, reclaims=2, return_state=True)
    assert state.is_completed(), state.message
    rows = attempts(home)
    assert [r.outcome.value for r in rows] == ["preempted", "preempted", "completed"]
    assert [r.resumed_from for r in rows] == [None, 30, 60]

    while True:
        with get_client(sync_client=True) as client:
            now = client.read_flow_run(victim_id).state
        if now is not None and now.is_crashed():
            break
        assert time.monotonic() - killed_at < PATIENCE_S, f"not marked Crashed: {now}"
        time.sleep(0.5)
    assert "no heartbeat for 10 s" in (now.message or ""), now.message
    with get_client(sync_client=True) as client:  # recorded from events: seconds after the flow ended
        tasks = client.read_task_runs()
    assert tasks and all(t.state is not None and t.state.is_completed() for t in tasks)
