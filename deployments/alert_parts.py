"""What every spotrun alert automation shares: the rules, the alert flow's parameters, the action.

Each automation runs the `restart-alert` deployment with parameters rendered from the event that fired
it (the server renders the Jinja strings; a string that is one `{{ expression }}` keeps its value's type).
deployments/automations.py and deployments/run_alerts.py build them from these pieces.
"""

from __future__ import annotations

from typing import Any
from uuid import UUID

from prefect.automations import AutomationCore, EventTrigger, Posture, RunDeployment
from pydantic import BaseModel, ConfigDict, Field

NAME_PREFIX = "spotrun"
ANY_JOB: dict[str, str | list[str]] = {"prefect.resource.id": "spotrun.job.*"}
TRAINING_FLOW = "resilient-training"
TERMINAL = ("Completed", "Failed", "Cancelled", "Crashed")


class AlertRules(BaseModel):
    """When to alert, and how hard the alert run tries to reach Slack."""

    model_config = ConfigDict(extra="forbid")

    restart_threshold: int = Field(default=3, ge=1, description="restarts of one job that make a storm")
    restart_window_s: float = Field(
        default=3600, gt=0, description="the window they must fall in, in seconds"
    )
    recovery_note: bool = Field(default=True, description="say so when a job that restarted completes")
    retries: int = Field(default=3, ge=0, le=20, description="delivery retries of the alert run")
    retry_delay_s: float = Field(default=30, ge=0, description="seconds between delivery retries")
    missed_run_after_s: float | None = Field(
        default=None,
        ge=60,
        description="a scheduled training run not finished this many seconds after its slot alerts; "
        "default: its schedule's period (the run must finish before the next slot)",
    )


def alert_parameters(kind: str, rules: AlertRules, **templated: Any) -> dict[str, Any]:
    return {
        "kind": kind,
        "job": "{{ event.payload.job }}",
        "window_s": rules.restart_window_s,
        "threshold": rules.restart_threshold,
        # default(''): the server renders with strict undefined; a missing key would fail the action
        "checkpoint": "{{ event.payload.checkpoint | default('') }}",
        "training_flow_run_id": "{{ event.payload.flow_run_id | default('') }}",
        "trigger": "{{ event.event }} {{ event.id }}",
        "retries": rules.retries,
        "retry_delay_s": rules.retry_delay_s,
        **templated,
    }


def automation(
    name: str, description: str, trigger: EventTrigger, *, deployment_id: UUID, parameters: dict[str, Any]
) -> AutomationCore:
    action = RunDeployment(
        source="selected", deployment_id=deployment_id, parameters=parameters, job_variables=None
    )
    return AutomationCore(name=name, description=description, trigger=trigger, actions=[action])


def first_event(event: str, match: dict[str, str | list[str]]) -> EventTrigger:
    """Fires on each such event (per job): threshold 1."""
    return EventTrigger(
        expect={event}, match=match, for_each={"prefect.resource.id"}, posture=Posture.Reactive, threshold=1
    )
