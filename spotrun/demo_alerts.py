"""The demo's alert path: spotrun deployed to the demo's server, a worker serving it, and the
restart-storm alert that the demo's preemptions raise, read back and shown in the terminal."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import cast

from rich.console import Console
from rich.markdown import Markdown
from rich.panel import Panel

from spotrun.deployments.apply import deploy
from spotrun.deployments.automations import AlertRules, delete_automations
from spotrun.deployments.worker import LocalWorker
from spotrun.tasks.history import AlertRow, AlertStatus, HistoryStore

ALERT_TIMEOUT_S = 120.0  # automation → scheduled run → worker → subprocess; SQLite 503s add ~2 s each
FINAL = {AlertStatus.SENT, AlertStatus.LOGGED, AlertStatus.FAILED}


@contextmanager
def alerting(log: Path, console: Console) -> Iterator[LocalWorker]:
    """Deploy spotrun with fresh automations (a kept server remembers the last demo's storm and would
    not fire again within the hour) and serve the pool with a worker that polls every second."""
    from prefect import get_client

    with get_client(sync_client=True) as client:
        delete_automations(client)
    rules = AlertRules(retries=1, retry_delay_s=5)
    t0 = time.monotonic()
    deploy(rules)
    worker = LocalWorker(log, query_s=1).start()
    console.print(
        f"deployed spotrun and started a worker in {time.monotonic() - t0:.0f} s: "
        f"{rules.restart_threshold} restarts within {rules.restart_window_s / 3600:g} h raise an alert",
        markup=False,
    )
    try:
        yield worker
    finally:
        worker.stop()


def wait_for_alert(database_url: str, job: str, timeout_s: float = ALERT_TIMEOUT_S) -> AlertRow | None:
    """The job's restart-storm alert once its run has tried to deliver it; None if none came."""
    deadline = time.monotonic() + timeout_s
    with HistoryStore.open(database_url) as store:
        while time.monotonic() < deadline:
            rows = [r for r in store.alerts(job=job, kind="restart-storm") if r.status in FINAL]
            if rows:
                return rows[-1]
            time.sleep(1)
    return None


def show_alert(console: Console, job: str, alert: AlertRow | None) -> list[str]:
    """Print the alert (its Markdown artifact, as the flow run published it); failures as strings."""
    if alert is None:
        return [f"no restart-storm alert for {job} within {ALERT_TIMEOUT_S:.0f} s (see the worker log)"]
    where = {
        AlertStatus.SENT: f"sent to Slack ({alert.channel})",
        AlertStatus.LOGGED: "no Slack configured (SPOTRUN_SLACK_WEBHOOK_URL): it went to the flow run's "
        "log and a Markdown artifact",
        AlertStatus.FAILED: f"Slack did not take it: {alert.error} (recorded as failed; retried)",
    }[alert.status]
    console.print(f"restart-storm alert for {job}: {where}", markup=False)
    markdown = _artifact(job) or alert.message
    console.print(Panel(Markdown(markdown), title="the alert", expand=False))
    return []


def _artifact(job: str) -> str | None:
    from prefect.artifacts import Artifact

    from spotrun.tasks.reports.reporting import artifact_key

    found = cast("Artifact | None", Artifact.get(artifact_key(job, "alert")))  # sync here
    return str(found.data) if found is not None and found.data else None
