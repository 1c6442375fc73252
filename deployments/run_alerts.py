"""The alert automations of scheduled retraining: a promotion decision, a training run that ended Failed,
a scheduled run not finished by its deadline (the alert flow dedups each once per run in SQL).

  - promotion (`spotrun.model.promotion`, tasks/decisions/promotion.py): every decision, moved or kept;
  - run failed: `FAILED_WAIT_S` after a deployment's training run ended Failed, unless it was started
    again meanwhile; the alert flow stays silent when the run's job run already raised a gave-up alert
    (a give-up ends the run Failed too, seconds after its own alert: the wait lets that alert be
    recorded first). Failed runs of `spotrun run` print their reason to whoever ran them;
  - missed run: one automation per scheduled training deployment (`build_missed_run_automations`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from datetime import timedelta
from uuid import UUID

from prefect.automations import AutomationCore, EventTrigger, Posture

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
from spotrun.deployments.schedules import ScheduledTraining
from spotrun.tasks.alerts.message import AlertKind, PromotionFacts
from spotrun.tasks.decisions.promotion import KEPT, PROMOTED, PROMOTION_LABEL
from spotrun.tasks.reports.reporting import MODEL_PROMOTION

PROMOTION = f"{NAME_PREFIX}: model promotion"
RUN_FAILED = f"{NAME_PREFIX}: training run failed"
MISSED_RUN = f"{NAME_PREFIX}: missed run: "  # + the deployment's name
FAILED_WAIT_S = 60  # a failed run's alert waits this long: its gave-up alert, if any, is recorded first
STARTED_AGAIN = ("Scheduled", "Pending", "Running", "Retrying", "AwaitingRetry")  # a failed run retried


def build_run_automations(
    rules: AlertRules, alert_deployment_id: UUID, scheduled: Sequence[ScheduledTraining] = ()
) -> list[AutomationCore]:
    """Promotion, run-failed and each scheduled deployment's missed-run automation (pure)."""
    return [
        _promotion(rules, alert_deployment_id),
        _run_failed(rules, alert_deployment_id),
        *build_missed_run_automations(rules, alert_deployment_id, scheduled),
    ]


def _promotion_facts() -> dict[str, str]:
    """The flow's `promotion` parameter: each PromotionFacts field from the event's payload
    (tasks/decisions/promotion.py event_payload), its type kept (a one-expression template), a default where
    an event lacks one."""
    empty = {
        f.name: repr(f.default) if isinstance(f.default, str) else str(f.default).lower()
        for f in dataclasses.fields(PromotionFacts)
    }
    empty = {k: "none" if v == "none" else v for k, v in empty.items()}
    return {name: f"{{{{ event.payload.{name} | default({e}) }}}}" for name, e in empty.items()}


def _promotion(rules: AlertRules, alert_deployment_id: UUID) -> AutomationCore:
    """Every promotion decision of a keyed run (tasks/decisions/promotion.py), moved or kept."""
    return automation(
        PROMOTION,
        "a keyed run's model was promoted to the alias, or the alias kept (with both values)",
        first_event(MODEL_PROMOTION, {**ANY_JOB, PROMOTION_LABEL: [PROMOTED, KEPT]}),
        deployment_id=alert_deployment_id,
        parameters=alert_parameters(AlertKind.PROMOTION.value, rules, promotion=_promotion_facts()),
    )


# A flow run's state event: the run is the event's resource; its job from the run's parameters (the
# server reads the run when a template names `flow_run`), else the name given.
_THE_RUN = "{{ event.resource.id | replace('prefect.flow-run.', '') }}"


def _run_job(fallback: str) -> str:
    return f"{{{{ flow_run.parameters.job.name | default({fallback}) }}}}"


def _run_failed(rules: AlertRules, alert_deployment_id: UUID) -> AutomationCore:
    """A deployment's training run that ended Failed (refused at start, gave up, a controller error)."""
    trigger = EventTrigger(
        after={"prefect.flow-run.Failed"},
        expect={f"prefect.flow-run.{s}" for s in STARTED_AGAIN},
        match={"prefect.resource.id": "prefect.flow-run.*"},
        match_related=[  # type: ignore[arg-type]  # pydantic coerces the dicts
            {"prefect.resource.role": "flow", "prefect.resource.name": TRAINING_FLOW},
            {"prefect.resource.role": "deployment"},  # any deployment's: `spotrun run` prints its own
        ],
        for_each={"prefect.resource.id"},
        posture=Posture.Proactive,
        threshold=1,
        within=timedelta(seconds=FAILED_WAIT_S),
    )
    parameters = alert_parameters(
        AlertKind.RUN_FAILED.value,
        rules,
        job=_run_job("event.resource.name"),  # a run's name: what the UI lists it by
        checkpoint="",
        reason="{{ event.resource['prefect.state-message'] | default('') }}",
        training_flow_run_id=_THE_RUN,
    )
    return automation(
        RUN_FAILED,
        f"a training run ended Failed and was not started again within {FAILED_WAIT_S} s (silent when its "
        "job run's gave-up alert told it)",
        trigger,
        deployment_id=alert_deployment_id,
        parameters=parameters,
    )


def build_missed_run_automations(
    rules: AlertRules, alert_deployment_id: UUID, scheduled: Sequence[ScheduledTraining]
) -> list[AutomationCore]:
    """One automation per scheduled training deployment: a run of it that has not ended by its deadline.

    The clock of each flow run starts at its first `Pending` (a worker took it, at its slot) or `Late`
    (nobody took it: Prefect's late-runs service marks a run still Scheduled 15 s after its slot, so a
    worker that is down, a paused pool or a full queue start the clock too). A run that reaches any end
    (Completed, Failed, Cancelled, Crashed) within the deadline stops it; one that does not alerts once,
    with its slot, its state and the deadline. A failed run has its own alert; a crashed one is rerun by
    recover-job, whose rerun is a flow run of the same deployment with a clock of its own (from its own
    start). Not caught: a slot for which the scheduler made no run (a paused schedule or deployment,
    which an operator chose) and a server that is down itself (nothing alerts then).

    The deadline: the job's own `deadline` (a duration counts from the slot, as the controller counts
    it), else `rules.missed_run_after_s` when set, else the schedule's period (the next slot); none for
    a deployment whose period is not known (an rrule schedule) without either.
    """
    out = []
    for d in scheduled:
        deadline = d.deadline_s or rules.missed_run_after_s or d.period_s
        if deadline is None:
            continue
        trigger = EventTrigger(
            after={"prefect.flow-run.Pending", "prefect.flow-run.Late"},
            expect={f"prefect.flow-run.{s}" for s in TERMINAL},
            match={"prefect.resource.id": "prefect.flow-run.*"},
            match_related=[  # type: ignore[arg-type]
                {"prefect.resource.role": "flow", "prefect.resource.name": TRAINING_FLOW},
                {"prefect.resource.role": "deployment", "prefect.resource.name": d.deployment},
            ],
            for_each={"prefect.resource.id"},
            posture=Posture.Proactive,
            threshold=1,
            within=timedelta(seconds=deadline),
        )
        parameters = alert_parameters(
            AlertKind.MISSED_RUN.value,
            rules,
            job=_run_job(repr(d.job)),
            window_s=deadline,
            checkpoint="{{ flow_run.expected_start_time | default('') | string }}",  # the slot
            reason="{{ flow_run.state.name | default('') }}",  # where the run is now
            training_flow_run_id=_THE_RUN,
        )
        description = (
            f"a run of {d.deployment} ({d.job}) has not ended {deadline:g} s after its slot "
            "(one alert per run)"
        )
        out.append(
            automation(
                MISSED_RUN + d.deployment,
                description,
                trigger,
                deployment_id=alert_deployment_id,
                parameters=parameters,
            )
        )
    return out
