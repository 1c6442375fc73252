"""A deployment run whose form parameters name another interpreter is refused in one line, through the
real flow: a deployment on a real Prefect server, a flow run created from it with the form's parameters,
run by Prefect's flow engine as a worker's flow process runs it (in this process)."""

from __future__ import annotations

import uuid
from pathlib import Path

from prefect import get_client
from prefect.flow_engine import run_flow
from prefect.states import State

from spotrun.flows.resilient_training import resilient_training
from spotrun.tasks.admission.trust import Allowed, settings_path, write_allowed
from tests.e2e.test_flow import job


def test_a_form_parameter_naming_another_interpreter_is_refused_in_one_line(
    prefect_api: str, home: Path, tmp_path: Path
) -> None:
    write_allowed(home, Allowed())  # as `spotrun deploy` writes it for the shipped deployments
    spec = job(tmp_path, name=f"trust-{uuid.uuid4().hex[:6]}")
    evil = str(tmp_path / "bin" / "python")
    params = {"job": spec.model_dump(mode="json"), "provider": {"kind": "local", "python": evil}}
    with get_client(sync_client=True) as client:
        flow_id = client.create_flow(resilient_training)
        dep_id = client.create_deployment(
            flow_id, "trust", entrypoint="spotrun.flows.resilient_training:resilient_training"
        )
        flow_run = client.create_flow_run_from_deployment(dep_id, parameters=params)
    state = run_flow(resilient_training, flow_run=flow_run, return_type="state")
    assert isinstance(state, State) and state.is_failed(), state
    assert state.message == (
        f"refused: provider.python: {evil!r} is not an interpreter this host lets a deployment run name; "
        f"add it under allow.python in {settings_path(home)}, or run the job file with `spotrun run`"
    )
    # nothing ran: no worker directory, no history, no checkpoint
    assert sorted(p.name for p in home.iterdir()) == ["allowed.yaml"]
    assert not Path(spec.storage).exists()
