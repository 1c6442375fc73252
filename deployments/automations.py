"""The alert automations, as code: built from `AlertRules`, applied to a Prefect server by name.

Each automation runs the `restart-alert` deployment with parameters rendered from the event that fired
it (deployments/alert_parts.py). Restart storms are counted per job (`for_each` on the job's
resource id): a reactive trigger fires once when a job reaches the threshold and then not again for the
rest of that window, so one storm starts one alert run; the alert flow dedups again in SQL. A
checkpoint the controller cannot verify, and a controller whose disk filled up during its check, alert
the same way with a threshold of 1: the first such event of a job starts an alert run, and its others in
the window (one per checkpoint, per check) start none.

Scheduled retraining adds a promotion alert, a failed-run alert and one missed-run alert per scheduled
training deployment (deployments/run_alerts.py). The shared pieces are in deployments/alert_parts.py.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Literal
from uuid import UUID

from prefect.automations import AutomationCore, EventTrigger, Posture, RunDeployment
from prefect.client.orchestration import SyncPrefectClient
from prefect.client.schemas.objects import StateType
from prefect.events.actions import ChangeFlowRunState
from pydantic import BaseModel, ConfigDict, Field

from spotrun.deployments.alert_parts import (
    ANY_JOB,
    NAME_PREFIX,
    TERMINAL,
    TRAINING_FLOW,
    AlertRules,
    alert_parameters,
    automation,
    first_event,
)
from spotrun.deployments.run_alerts import build_run_automations
from spotrun.deployments.schedules import ScheduledTraining
from spotrun.tasks.alerts.message import AlertKind, ResumeFacts
from spotrun.tasks.control.checkpoints import CHECKPOINT_UNVERIFIED, CONTROLLER_DISK_FULL
from spotrun.tasks.control.market import DEADLINE_AT_RISK
from spotrun.tasks.reports.reporting import (
    JOB_COMPLETED,
    JOB_GAVE_UP,
    JOB_RESTARTED,
    RESTARTED_LABEL,
    RESUME_CHECKED,
    VERDICT_LABEL,
)

STORM = f"{NAME_PREFIX}: restart storm"
GAVE_UP = f"{NAME_PREFIX}: job gave up"
RECOVERED = f"{NAME_PREFIX}: job recovered"
ZOMBIE = f"{NAME_PREFIX}: zombie training run"
CRASHED = f"{NAME_PREFIX}: restart crashed training"
MISMATCH = f"{NAME_PREFIX}: resume mismatch"
UNVERIFIED = f"{NAME_PREFIX}: checkpoint cannot be verified"
DISK_FULL = f"{NAME_PREFIX}: controller disk full"
AT_RISK = f"{NAME_PREFIX}: deadline at risk"
HEARTBEAT_TAG = "spotrun-heartbeat"  # prefect.yaml: the deployments whose runs beat every HEARTBEAT_S
HEARTBEAT_S = 30  # PREFECT_FLOWS_HEARTBEAT_FREQUENCY of those runs; Prefect's minimum


class RecoveryRules(BaseModel):
    """How a training run whose controller died is found and restarted."""

    model_config = ConfigDict(extra="forbid")

    controller_restarts: int = Field(
        default=3, ge=0, le=100, description="restarts of one job per window after its controller died"
    )
    restart_window_s: float = Field(default=3600, gt=0, description="... the window, in seconds")
    zombie_after_s: float = Field(
        default=90,
        ge=2 * HEARTBEAT_S,  # one late heartbeat on a busy host must not crash a live run
        le=86400,
        description="mark a training run Crashed after this many seconds without a heartbeat",
    )


def _resume_check() -> dict[str, str]:
    """The flow's `resume` parameter: each ResumeFacts field from the event's payload (the flow refuses
    other keys); '' or 0 where an older event lacks one."""
    empty = {f.name: "''" if f.default == "" else "0" for f in dataclasses.fields(ResumeFacts)}
    return {name: f"{{{{ event.payload.{name} | default({e}) }}}}" for name, e in empty.items()}


def build_automations(
    rules: AlertRules, alert_deployment_id: UUID, scheduled: Sequence[ScheduledTraining] = ()
) -> list[AutomationCore]:
    """The automations spotrun wants on the server for these rules (pure: no API calls); `scheduled`:
    prefect.yaml's scheduled training deployments (deployments/schedules.py `scheduled_training`)."""
    storm = EventTrigger(
        expect={JOB_RESTARTED},
        match=ANY_JOB,
        for_each={"prefect.resource.id"},
        posture=Posture.Reactive,
        threshold=rules.restart_threshold,
        within=timedelta(seconds=rules.restart_window_s),
    )
    out = [
        automation(
            STORM,
            f"{rules.restart_threshold} restarts of one job within {rules.restart_window_s:g} s",
            storm,
            deployment_id=alert_deployment_id,
            parameters=alert_parameters("restart-storm", rules),
        ),
        automation(
            GAVE_UP,
            "a job ran out of its restart budget",
            first_event(JOB_GAVE_UP, ANY_JOB),
            deployment_id=alert_deployment_id,
            parameters=alert_parameters("gave-up", rules, reason="{{ event.payload.reason | default('') }}"),
        ),
    ]
    if rules.recovery_note:
        restarted: dict[str, str | list[str]] = {**ANY_JOB, RESTARTED_LABEL: "true"}
        out.append(
            automation(
                RECOVERED,
                "a job that restarted completed (a note only if it had alerted)",
                first_event(JOB_COMPLETED, restarted),
                deployment_id=alert_deployment_id,
                parameters=alert_parameters("recovered", rules),
            )
        )
    mismatch: dict[str, str | list[str]] = {**ANY_JOB, VERDICT_LABEL: "mismatch"}
    out.append(
        automation(
            MISMATCH,
            "a resumed attempt did not continue the lost one's training (resume check: mismatch)",
            first_event(RESUME_CHECKED, mismatch),
            deployment_id=alert_deployment_id,
            parameters=alert_parameters("resume-mismatch", rules, resume=_resume_check()),
        )
    )
    out.append(_unverified(rules, alert_deployment_id))
    out.append(_disk_full(rules, alert_deployment_id))
    out.append(_at_risk(rules, alert_deployment_id))
    return out + build_run_automations(rules, alert_deployment_id, scheduled)


def _once_a_window(event: str, rules: AlertRules) -> EventTrigger:
    """Fires on a job's first such event, then not again for the rest of the window (per job)."""
    return EventTrigger(
        expect={event},
        match=ANY_JOB,
        for_each={"prefect.resource.id"},
        posture=Posture.Reactive,
        threshold=1,
        within=timedelta(seconds=rules.restart_window_s),
    )


# The events from the check between attempts carry no flow run id; `flow_run` is the run one was
# emitted in (the server reads it from the event's related resources; '' when there is none). One
# expression renders through `tojson`, which refuses a UUID: `string` first.
_EMITTING_RUN = "{{ flow_run.id | default('') | string }}"


def _unverified(rules: AlertRules, alert_deployment_id: UUID) -> AutomationCore:
    """A checkpoint whose signature the controller cannot check (tasks/control/checkpoints.py)."""
    return _once_a_window_alert(
        rules,
        alert_deployment_id,
        name=UNVERIFIED,
        kind=AlertKind.CANNOT_VERIFY,
        event=CHECKPOINT_UNVERIFIED,
        checkpoint="step {{ event.payload.step | default('?') }}",
        what="a checkpoint's signature cannot be checked with the controller's keys",
        then="it is kept, never quarantined",
    )


def _disk_full(rules: AlertRules, alert_deployment_id: UUID) -> AutomationCore:
    """The controller's disk filled up during its check (tasks/control/loop.py): `checkpoint` says where,
    the flow cache and its host (an older event without them: what it has)."""
    return _once_a_window_alert(
        rules,
        alert_deployment_id,
        name=DISK_FULL,
        kind=AlertKind.DISK_FULL,
        event=CONTROLLER_DISK_FULL,
        checkpoint="{{ event.payload.cache | default('') }}"
        "{% if event.payload.host is defined %} on {{ event.payload.host }}{% endif %}",
        what="the controller's disk filled up during its checkpoint check",
        then="the check was skipped and the next one retries",
    )


def _at_risk(rules: AlertRules, alert_deployment_id: UUID) -> AutomationCore:
    """A job that even on-demand can no longer finish by its deadline (tasks/control/market.py)."""
    return _once_a_window_alert(
        rules,
        alert_deployment_id,
        name=AT_RISK,
        kind=AlertKind.DEADLINE_AT_RISK,
        event=DEADLINE_AT_RISK,
        checkpoint="{{ event.payload.deadline | default('') }}",
        what="a job cannot make its deadline even on on-demand",
        then="it goes on best-effort",
    )


def _once_a_window_alert(
    rules: AlertRules,
    alert_deployment_id: UUID,
    *,
    name: str,
    kind: AlertKind,
    event: str,
    checkpoint: str,
    what: str,
    then: str,
) -> AutomationCore:
    """An alert about one job's `event`, at most once a window: `checkpoint` (a template) says what it
    is about, the event's `problem` why."""
    parameters = alert_parameters(
        kind.value,
        rules,
        checkpoint=checkpoint,
        reason="{{ event.payload.problem | default('') }}",
        training_flow_run_id=_EMITTING_RUN,
    )
    return automation(
        name,
        f"{what} (at most one alert per job within {rules.restart_window_s:g} s); {then}",
        _once_a_window(event, rules),
        deployment_id=alert_deployment_id,
        parameters=parameters,
    )


def _training_runs() -> list[dict[str, str | list[str]]]:
    """Related-resource filters (all must match): the training flow, in a run that beats."""
    role = "prefect.resource.role"
    return [
        {role: "flow", "prefect.resource.name": TRAINING_FLOW},
        {role: "tag", "prefect.resource.id": f"prefect.tag.{HEARTBEAT_TAG}"},
    ]


def build_recovery_automations(rules: RecoveryRules, recover_deployment_id: UUID) -> list[AutomationCore]:
    """The zombie and crashed automations (pure: no API calls)."""
    runs: dict[str, str | list[str]] = {"prefect.resource.id": "prefect.flow-run.*"}
    # armed by the run's Running as well as by a heartbeat: a controller that dies before its first
    # heartbeat is stored (measured at 50 jobs on a SQLite server, bench/scale.py) is caught too
    zombie = EventTrigger(
        after={"prefect.flow-run.heartbeat", "prefect.flow-run.Running"},
        expect={"prefect.flow-run.heartbeat", *(f"prefect.flow-run.{s}" for s in TERMINAL)},
        match=runs,
        match_related=_training_runs(),  # type: ignore[arg-type]  # pydantic coerces the dicts
        for_each={"prefect.resource.id"},
        posture=Posture.Proactive,
        threshold=1,
        within=timedelta(seconds=rules.zombie_after_s),
    )
    mark = ChangeFlowRunState(
        name=None,
        state=StateType.CRASHED,
        force=False,  # a run that ended meanwhile keeps its final state
        message=f"no heartbeat for {rules.zombie_after_s:g} s: its host, worker or process is gone",
    )
    crashed = EventTrigger(
        expect={"prefect.flow-run.Crashed"},
        match=runs,
        match_related=_training_runs(),  # type: ignore[arg-type]
        for_each={"prefect.resource.id"},
        posture=Posture.Reactive,
        threshold=1,
    )
    parameters = {
        # default(''): the server renders with strict undefined; recover-job rejects '' in one line
        "crashed_flow_run_id": "{{ event.resource.id | default('') }}",
        "limit": rules.controller_restarts,
        "window_s": rules.restart_window_s,
    }
    restart = RunDeployment(
        source="selected", deployment_id=recover_deployment_id, parameters=parameters, job_variables=None
    )
    return [
        AutomationCore(
            name=ZOMBIE,
            description=f"a training run sent no heartbeat for {rules.zombie_after_s:g} s: mark it Crashed",
            trigger=zombie,
            actions=[mark],
        ),
        AutomationCore(
            name=CRASHED,
            description=f"rerun a crashed training run (at most {rules.controller_restarts} per job "
            f"within {rules.restart_window_s:g} s, then a gave-up alert)",
            trigger=crashed,
            actions=[restart],
        ),
    ]


Change = Literal["created", "updated", "unchanged", "deleted"]


@dataclass(frozen=True)
class Applied:
    name: str
    change: Change
    id: UUID | None


def _comparable(a: AutomationCore) -> Any:
    """The automation's definition with its sets sorted. Dumped to JSON as they are, sets (a
    trigger's `expect`, `after`, `for_each`) come out in hash order, which differs from process to
    process: every `spotrun serve` then "updated" the zombie automation, and an update drops the
    trigger's armed buckets, so a run that had died before it was never marked Crashed (seen after a
    host loss: the restarted serve re-applied the automation 40 s after the dead run's last heartbeat)."""
    return _sorted_sets(a.model_dump(exclude={"id", "created", "updated"}))


def _sorted_sets(v: Any) -> Any:
    if isinstance(v, set | frozenset):
        return sorted((_sorted_sets(x) for x in v), key=repr)
    if isinstance(v, dict):
        return {k: _sorted_sets(x) for k, x in v.items()}
    if isinstance(v, list | tuple):
        return [_sorted_sets(x) for x in v]
    return v


def apply_automations(client: SyncPrefectClient, wanted: list[AutomationCore]) -> list[Applied]:
    """Create or update each automation by name, so applying twice changes nothing; remove duplicates
    of a name and spotrun automations no longer wanted (e.g. the recovery note switched off)."""
    applied: list[Applied] = []
    for a in wanted:
        found = client.read_automations_by_name(a.name)
        for extra in found[1:]:
            client.delete_automation(extra.id)
        if not found:
            applied.append(Applied(a.name, "created", client.create_automation(a)))
        elif _comparable(AutomationCore.model_validate(found[0].model_dump())) == _comparable(a):
            applied.append(Applied(a.name, "unchanged", found[0].id))
        else:
            client.update_automation(found[0].id, a)
            applied.append(Applied(a.name, "updated", found[0].id))
    names = {a.name for a in wanted}
    for stale in spotrun_automations(client):
        if stale.name not in names:
            client.delete_automation(stale.id)
            applied.append(Applied(stale.name, "deleted", stale.id))
    return applied


def spotrun_automations(client: SyncPrefectClient) -> list[Any]:
    """Every automation on the server whose name marks it as spotrun's."""
    return [a for a in client.read_automations() if a.name.startswith(f"{NAME_PREFIX}:")]


def delete_automations(client: SyncPrefectClient) -> int:
    """Remove spotrun's automations (tests, `spotrun deploy --remove-alerts`); returns how many."""
    found = spotrun_automations(client)
    for a in found:
        client.delete_automation(a.id)
    return len(found)
