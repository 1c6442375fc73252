"""The restart alert: run by the spotrun automations (deployments/automations.py) when a job keeps
restarting, gives up, recovers after an alert, resumes with different results (a resume check's
`mismatch`), has a checkpoint whose signature the controller cannot verify (`cannot-verify`: the
event's step as `checkpoint`, its problem as `reason`), or fills the controller's disk (`disk-full`:
where as `checkpoint`, the OS error as `reason`), moves or keeps a model alias (`promotion`), ends
Failed (`run-failed`) or misses its scheduled run's deadline (`missed-run`). Reads the restart history
from SQL, tells Slack (or, with no Slack configured, the run log and a Markdown artifact) and records
every try in SQL.

A Slack outage never touches training: this is its own flow run, started by the server; a delivery
that fails is recorded as failed and retried `retries` times, `retry_delay_s` apart.
"""

from __future__ import annotations

from prefect import flow

from spotrun.tasks.alerts.message import AlertKind, PromotionFacts, ResumeFacts
from spotrun.tasks.alerts.prefect_tasks import publish_alert, send_alert, slack_target
from spotrun.tasks.alerts.service import AlertRequest
from spotrun.tasks.settings import Settings


def flow_run_url(flow_run_id: str) -> str | None:
    """The training flow run in the Prefect UI (PREFECT_UI_URL, derived from the API URL by default)."""
    from prefect.settings import PREFECT_UI_URL

    base = PREFECT_UI_URL.value()
    return f"{str(base).rstrip('/')}/runs/flow-run/{flow_run_id}" if base and flow_run_id else None


@flow(name="restart-alert", description="Tell people about a job that keeps restarting.")
def restart_alert(
    job: str,
    kind: AlertKind = AlertKind.RESTART_STORM,
    window_s: float = 3600,
    threshold: int = 3,
    checkpoint: str = "",
    training_flow_run_id: str = "",
    trigger: str = "",
    reason: str = "",
    retries: int = 3,
    retry_delay_s: float = 30,
    resume: ResumeFacts | None = None,
    promotion: PromotionFacts | None = None,
) -> dict[str, str]:
    """`resume`: for a resume-mismatch alert, the check; `promotion`: for a promotion alert, the
    decision (each the event's payload; other keys are ignored)."""
    request = AlertRequest(
        kind=kind,
        job=job,
        window_s=window_s,
        threshold=threshold,
        checkpoint=checkpoint or None,
        flow_run_url=flow_run_url(training_flow_run_id),
        reason=reason,
        trigger=trigger,
        resume=resume,
        promotion=promotion,
        flow_run_id=training_flow_run_id,
    )
    sender = send_alert.with_options(retries=retries, retry_delay_seconds=retry_delay_s)
    result = sender(Settings.from_env(), request, slack_target())
    publish_alert(job, result)
    return {"status": str(result.status), "key": result.key, "reason": result.reason}
