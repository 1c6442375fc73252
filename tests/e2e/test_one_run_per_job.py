"""One flow run per job against a real Prefect server: while a run trains, a second run of the job under
"reject" ends Failed naming it and records nothing; a third under "wait" waits, then finds the job
complete; the store ends bitwise equal to an uninterrupted run."""

from __future__ import annotations

import time
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from contextvars import copy_context
from pathlib import Path
from typing import Any

import pytest
from prefect import get_client
from prefect.client.schemas.actions import GlobalConcurrencyLimitCreate, GlobalConcurrencyLimitUpdate
from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId
from prefect.exceptions import ObjectNotFound

from spotrun.server import flush_to_api
from spotrun.tasks.decisions.policy import RetryPolicy
from spotrun.tasks.history import HistoryStore
from spotrun.tasks.ownership import job_slot
from spotrun.tasks.ownership.job_slot import limit_name
from spotrun.tasks.providers.local import LocalProviderConfig
from spotrun.trainer.checkpoint.format import step_dir
from tests.e2e.test_flow import attempts, job, reference_dir, run_flow, schedule
from tests.trainer_runs import assert_states_equal


def active_slots(name: str) -> int:
    with get_client(sync_client=True) as client:
        try:
            return client.read_global_concurrency_limit_by_name(name).active_slots
        except ObjectNotFound:
            return 0


def logs_of(flow_run_id: Any) -> str:
    flush_to_api()
    with get_client(sync_client=True) as client:
        logs = client.read_logs(LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id])))
    return "\n".join(log.message for log in logs)


def test_a_second_run_is_refused_and_a_third_waits_for_the_first(
    prefect_api: str, home: Path, tmp_path: Path
) -> None:
    spec = job(tmp_path, name=f"once-{uuid.uuid4().hex[:6]}", total_steps=1500)
    provider = schedule((0.5, True))  # one reclaim: the holder runs through two trainer starts
    with ThreadPoolExecutor(2) as pool:
        # each thread in a copy of this context: Prefect's settings (the server's URL) live in contextvars
        first: Future[Any] = pool.submit(copy_context().run, run_flow, spec, provider)
        while not active_slots(limit_name(spec.name)):
            assert not first.done(), first.result().message
            time.sleep(0.2)
        refused = run_flow(spec, provider, RetryPolicy(duplicate_runs="reject"))
        waiter: Future[Any] = pool.submit(copy_context().run, run_flow, spec, provider)
        held, waited = first.result(), waiter.result()
    assert held.is_completed(), held.message
    assert waited.is_completed(), waited.message
    with get_client(sync_client=True) as client:
        holder = client.read_flow_run(held.state_details.flow_run_id)
    assert refused.is_failed()
    assert f"job {spec.name} is already running in flow run {holder.name}" in refused.message
    assert "refused (duplicate_runs: reject)" in refused.message
    assert f"already running in flow run {holder.name} ({holder.id}); waiting" in logs_of(
        waited.state_details.flow_run_id
    )
    store = HistoryStore.open(f"sqlite:///{home / 'history.db'}")
    try:
        runs = {r.flow_run_id: r for r in store.job_runs(spec.name)}
    finally:
        store.close()
    assert str(refused.state_details.flow_run_id) not in runs  # the refused run recorded nothing
    assert set(runs) == {str(held.state_details.flow_run_id), str(waited.state_details.flow_run_id)}
    waited_run = runs[str(waited.state_details.flow_run_id)].id
    outcomes = [r.outcome.value for r in attempts(home) if r.job_run_id == waited_run]
    assert outcomes == []  # the job was done: no worker, no attempt row, and the run says so
    assert waited.message == f"already completed at step {spec.total_steps} in {spec.storage}: nothing to run"
    assert runs[str(waited.state_details.flow_run_id)].status.value == "completed"
    assert active_slots(limit_name(spec.name)) == 0
    assert_states_equal(Path(spec.storage) / step_dir(spec.total_steps), reference_dir(spec, tmp_path))


def test_a_slot_left_taken_by_a_server_restart_is_freed_by_the_waiting_run(
    prefect_api: str, home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A restarted server keeps active_slots in its database but lost the leases (held in memory): the
    # slot is taken with no lease to lapse and no run to hold it. The real wait is ORPHAN_S (90 s).
    monkeypatch.setattr(job_slot, "ORPHAN_S", 1.0)
    monkeypatch.setattr(job_slot, "POLL_S", 0.2)
    spec = job(tmp_path, name=f"orphan-{uuid.uuid4().hex[:6]}", total_steps=50, args={"hidden": 16})
    name = limit_name(spec.name)
    with get_client(sync_client=True) as client:
        client.create_global_concurrency_limit(GlobalConcurrencyLimitCreate(name=name, limit=1))
        client.update_global_concurrency_limit(name, GlobalConcurrencyLimitUpdate(active_slots=1))
    state = run_flow(spec, LocalProviderConfig())
    assert state.is_completed(), state.message
    said = logs_of(state.state_details.flow_run_id)
    assert "no running run of it is listed" in said and "waiting" in said
    assert f"{name} stayed taken 1 s with no running flow run of the job" in said
    assert active_slots(name) == 0
