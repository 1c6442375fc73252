"""Restart a training run whose controller died: the pure decision, and what it reads from the API.

A flow run goes Crashed when its process dies under a live worker, or when the zombie automation
(deployments/automations.py) hears no heartbeat for a while (host loss: worker, flow and `spotrun
serve` gone together). Prefect's flow `retries` do not cover Crashed, so the crashed automation runs
the `recover-job` flow, which runs the same deployment again with the same parameters; the new run
adopts the job (its `job_runs` row is still `running`) and resumes from the newest checkpoint.

Bounded: at most `limit` controller restarts per job within `window` (3 per hour by default), then a
gave-up event, which the gave-up alert automation takes to Slack. The restarts are counted from the
Prefect flow runs recover-job created (tagged `spotrun-restart` and `spotrun-job:<name>`): they live in
the server's database, so the count survives restarts of everything else, and a run is readable as
soon as it is created, while events are only readable after the event persister's flush (~5 s), too
late for two crashes in quick succession.

Idempotent per crash: the restarted run carries `spotrun-recovers:<crashed flow run id>` and the same
idempotency key, so a second recover-job run for the same crash finds it and does nothing.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any
from uuid import UUID

from prefect.client.orchestration import SyncPrefectClient
from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterTags
from prefect.client.schemas.objects import FlowRun, StateType
from prefect.client.schemas.sorting import FlowRunSort
from prefect.exceptions import ObjectNotFound

from spotrun.trainer.errors import SpotrunError

JOB_CRASHED = "spotrun.job.crashed"
RESTART_TAG = "spotrun-restart"  # on every run recover-job started
FLOW_RUN_PREFIX = "prefect.flow-run."


class RecoveryError(SpotrunError):
    """The crashed run cannot be rerun (unknown id, not a deployment run); the message says why."""


def job_tag(job: str) -> str:
    return f"spotrun-job:{job}"


def recovers_tag(crashed_flow_run_id: UUID) -> str:
    return f"spotrun-recovers:{crashed_flow_run_id}"


def recovered_run(tags: list[str]) -> str:
    """The crashed flow run a run was started to replace, from its tags; "" for any other run."""
    prefix = recovers_tag(UUID(int=0)).split(":", 1)[0] + ":"
    return next((t.removeprefix(prefix) for t in tags if t.startswith(prefix)), "")


def idempotency_key(crashed_flow_run_id: UUID) -> str:
    return f"spotrun-recover-{crashed_flow_run_id}"


class RestartAction(enum.StrEnum):
    RESTART = "restart"
    GIVE_UP = "give_up"
    LEAVE = "leave"  # someone asked to cancel the run before it crashed: not ours to restart


@dataclass(frozen=True)
class RestartDecision:
    action: RestartAction
    reason: str  # one line; for give_up, the reason the gave-up alert shows
    restarts: int = 0  # controller restarts of the job within the window, before this one


def decide_controller_restart(
    recent_restart_times: Sequence[datetime],
    now: datetime,
    limit: int,
    *,
    window: timedelta,
    cancel_requested: bool = False,
) -> RestartDecision:
    """Restart a crashed run unless the job already had `limit` controller restarts within `window`."""
    if cancel_requested:
        return RestartDecision(RestartAction.LEAVE, "the run was being cancelled when it crashed")
    recent = [t for t in recent_restart_times if now - window < t <= now]
    if len(recent) >= limit:
        return RestartDecision(
            RestartAction.GIVE_UP,
            f"controller died {len(recent) + 1} times within {window.total_seconds():g} s "
            f"(at most {limit} restarts): restart it by hand once the host is sound",
            len(recent),
        )
    return RestartDecision(
        RestartAction.RESTART, f"controller restart {len(recent) + 1} of {limit}", len(recent)
    )


@dataclass(frozen=True)
class CrashedRun:
    """What recover-job needs of the crashed run."""

    flow_run_id: UUID
    deployment_id: UUID
    job: str
    parameters: dict[str, Any]
    cancel_requested: bool


def parse_flow_run_id(text: str) -> UUID:
    """A flow run id, bare or as the event's resource id (`prefect.flow-run.<id>`)."""
    try:
        return UUID(text.strip().removeprefix(FLOW_RUN_PREFIX))
    except ValueError:
        raise RecoveryError(
            f"crashed_flow_run_id {text!r} is not a flow run id: pass the id of the crashed run"
        ) from None


def read_crashed_run(client: SyncPrefectClient, flow_run_id: UUID) -> CrashedRun:
    """The crashed run's deployment, parameters and job name, read from the API."""
    try:
        run = client.read_flow_run(flow_run_id)
    except ObjectNotFound:
        raise RecoveryError(f"no flow run {flow_run_id} on this server") from None
    if run.deployment_id is None:
        raise RecoveryError(f"flow run {flow_run_id} was not started from a deployment: nothing to rerun")
    job = (run.parameters.get("job") or {}).get("name")
    if not isinstance(job, str) or not job:
        raise RecoveryError(f"flow run {flow_run_id} has no job.name parameter: not a training run")
    states = client.read_flow_run_states(flow_run_id)
    cancelling = any(s.type in (StateType.CANCELLING, StateType.CANCELLED) for s in states)
    return CrashedRun(
        flow_run_id, run.deployment_id, job, parameters=dict(run.parameters), cancel_requested=cancelling
    )


def _tagged(client: SyncPrefectClient, *tags: str, limit: int = 200) -> list[FlowRun]:
    """The newest `limit` runs carrying all `tags` (restarts are created to run at once, so the newest
    expected start is the newest restart; the server caps a page at 200 anyway)."""
    return client.read_flow_runs(
        flow_run_filter=FlowRunFilter(tags=FlowRunFilterTags(all_=list(tags))),
        sort=FlowRunSort.EXPECTED_START_TIME_DESC,
        limit=limit,
    )


def restart_of(client: SyncPrefectClient, crashed_flow_run_id: UUID) -> FlowRun | None:
    """The run an earlier recover-job already started for this crash, if any."""
    found = _tagged(client, RESTART_TAG, recovers_tag(crashed_flow_run_id))
    return found[0] if found else None


def restart_times(client: SyncPrefectClient, job: str) -> list[datetime]:
    """When recover-job restarted this job (all time; the decision keeps the window)."""
    return [r.created for r in _tagged(client, RESTART_TAG, job_tag(job)) if r.created is not None]
