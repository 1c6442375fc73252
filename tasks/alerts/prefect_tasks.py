"""Prefect tasks around the alert domain (tasks/alerts): find the Slack target, raise one alert."""

from __future__ import annotations

import os

from prefect import get_run_logger, task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import NO_CACHE

from spotrun.tasks.alerts.secrets import prefect_secret
from spotrun.tasks.alerts.service import AlertRequest, AlertResult, raise_alert
from spotrun.tasks.alerts.slack import SlackTarget, target_from_env
from spotrun.tasks.history import AlertStatus, HistoryStore
from spotrun.tasks.reports.reporting import artifact_key
from spotrun.tasks.settings import Settings


class AlertNotDelivered(RuntimeError):
    """Slack did not take the alert; the task retries, and every try is recorded in SQL."""


def slack_target() -> SlackTarget | None:
    """SPOTRUN_SLACK_* from the environment, else the spotrun-slack-* Secret blocks; None: log only."""
    return target_from_env(os.environ, prefect_secret)


@task(name="send-alert", cache_policy=NO_CACHE)
def send_alert(settings: Settings, request: AlertRequest, target: SlackTarget | None) -> AlertResult:
    """Raise one alert (deduplicated in SQL); raises AlertNotDelivered when Slack did not take it."""
    log = get_run_logger()
    with HistoryStore.open(settings.database_url, journal_dir=settings.journal_dir) as store:
        result = raise_alert(store, request, target)
        store.flush()
    where = target.describe() if target is not None else "the flow run log (no Slack configured)"
    log.info("alert %s for %s: %s via %s (%s)", request.kind, request.job, result.status, where, result.key)
    if result.status is AlertStatus.FAILED:
        error = result.delivery.error if result.delivery is not None else "unknown error"
        raise AlertNotDelivered(f"alert {result.key} not delivered to {where}: {error}")
    return result


def publish_alert(job: str, result: AlertResult) -> None:
    """The alert as Markdown in the flow run's log and as an artifact, whether Slack got it or not."""
    if result.status is AlertStatus.SUPPRESSED:
        get_run_logger().info("not announced again: %s", result.reason)
        return
    get_run_logger().warning("%s", result.markdown)
    create_markdown_artifact(
        result.markdown, key=artifact_key(job, "alert"), description=f"the latest alert about {job}"
    )
