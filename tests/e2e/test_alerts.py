"""Deployments, automations and restart-storm alerts against a real Prefect server: `deploy` applied,
a real process worker running the restart-alert deployment, and a Slack webhook on 127.0.0.1.

One server, worker and Slack stand-in serve the whole module (starting them costs ~20 s); each test
uses its own job names, since a storm is counted per job and announced once per window.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from prefect import flow, get_client
from prefect.blocks.system import Secret
from prefect.client.schemas.filters import (
    ArtifactFilter,
    ArtifactFilterKey,
    DeploymentFilter,
    DeploymentFilterId,
    FlowRunFilter,
    FlowRunFilterId,
)

from spotrun.deployments.apply import ALERT_DEPLOYMENT, DeployReport, deploy
from spotrun.deployments.automations import AlertRules, delete_automations, spotrun_automations
from spotrun.deployments.worker import LocalWorker
from spotrun.server import flush_to_api, free_port, patched_environ
from spotrun.tasks.control.checkpoints import CHECKPOINT_UNVERIFIED
from spotrun.tasks.decisions.attempts import AttemptRecord, Outcome
from spotrun.tasks.history import AlertStatus, HistoryStore
from spotrun.tasks.reports import reporting as report
from spotrun.tasks.reports.prefect_sink import PrefectSink
from tests.e2e.test_flow import job, run_flow, schedule
from tests.prefect_server import PrefectServer
from tests.servers import SlackFake
from tests.ui import chromium_missing, screenshots

# Deliveries retry once, 1 s apart, so "Slack is down" settles in seconds.
RULES = AlertRules(restart_threshold=3, restart_window_s=3600, retries=1, retry_delay_s=1)
WEBHOOK_SECRET = "spotrun-slack-webhook-url"
ALERT_TIMEOUT_S = 120  # automation → scheduled run → worker poll (1 s) → subprocess → Slack; SQLite 503s
SCREENSHOTS = os.environ.get("SPOTRUN_SCREENSHOTS")  # `make ui-screenshots` copies them to docs/img


@dataclass
class Stack:
    server: PrefectServer
    slack: SlackFake
    worker: LocalWorker
    report: DeployReport
    home: Path
    database_url: str

    def store(self) -> HistoryStore:
        return HistoryStore.open(self.database_url)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    root = tmp_path_factory.mktemp("alerts")
    home, db = root / "home", f"sqlite:///{root / 'history.db'}"
    slack = SlackFake().start()
    server = PrefectServer(root / "prefect").start()
    env = {**server.env(), "SPOTRUN_HOME": str(home), "SPOTRUN_DATABASE_URL": db}
    # The worker's flow runs find Slack through the Secret block (set per test), not the environment.
    hidden = {k: os.environ.pop(k) for k in list(os.environ) if k.startswith("SPOTRUN_SLACK_")}
    try:
        with patched_environ(**env), server.clients():
            Secret(value=slack.url).save(WEBHOOK_SECRET, overwrite=True)
            applied = deploy(RULES)
            worker = LocalWorker(root / "worker.log", query_s=1).start()
            try:
                yield Stack(server, slack, worker, report=applied, home=home, database_url=db)
            finally:
                worker.stop()
                with get_client(sync_client=True) as client:
                    delete_automations(client)  # a wildcard automation would fire on later events
                flush_to_api()
    finally:
        os.environ.update(hidden)
        server.stop()
        slack.stop()


def seed_restarts(stack: Stack, job_name: str, n: int) -> None:
    """Record n preemptions of a job in SQL, then emit their restart events, as the flow does."""
    store = stack.store()
    run = store.start_job_run(
        job_name, "spec-hash", str(uuid.uuid4()), storage_uri="/tmp/store", provider="local"
    )
    now = time.time()
    for i in range(1, n + 1):
        record = AttemptRecord(
            attempt=i,
            worker_id=f"local-{i}",
            provider="local",
            started_at=now - 100 + 10 * i,
            ended_at=now - 95 + 10 * i,
            outcome=Outcome.PREEMPTED,
            cause=f"spot notice {i} (SIGTERM), exited PREEMPTED",
            log_tail=f"step {100 * i} loss 0.5\nreclaimed by the spot market ({job_name} #{i})",
            last_step=100 * i,
            last_durable_step=100 * i - 25,
            lost_steps=25,
        )
        store.record_attempt(run, record)
    store.close()
    for i in range(1, n + 1):
        report.emit(
            report.JOB_RESTARTED,
            job_name,
            attempt=i,
            cause=f"spot notice {i}",
            checkpoint=f"/tmp/store/step-{100 * i - 25:010d}",
            lost_steps=25,
            flow_run_id=str(uuid.uuid4()),
            restarts=i,
        )
    flush_to_api()


def alert_runs(job_name: str, timeout_s: float = ALERT_TIMEOUT_S, count: int = 1) -> list[Any]:
    """The restart-alert flow runs for a job, once `count` of them have reached a final state."""
    with get_client(sync_client=True) as client:
        dep = client.read_deployment_by_name(ALERT_DEPLOYMENT)
        deadline = time.monotonic() + timeout_s
        while True:
            runs = client.read_flow_runs(
                deployment_filter=DeploymentFilter(id=DeploymentFilterId(any_=[dep.id]))
            )
            mine = [r for r in runs if r.parameters.get("job") == job_name]
            done = [r for r in mine if r.state is not None and r.state.is_final()]
            if len(done) >= count or time.monotonic() > deadline:
                return done
            time.sleep(1)


def messages_about(stack: Stack, job_name: str) -> list[dict[str, Any]]:
    return [m for m in stack.slack.delivered() if job_name in json.dumps(m)]


def test_deploy_twice_changes_nothing(stack: Stack) -> None:
    again = deploy(RULES)
    assert again.deployments == stack.report.deployments
    assert {a.change for a in again.automations} == {"unchanged"}
    assert [a.id for a in again.automations] == [a.id for a in stack.report.automations]
    with get_client(sync_client=True) as client:
        # storm, gave up, recovered, mismatch, unverified, disk full, deadline at risk, promotion, run
        # failed, missed run (nightly-retraining), zombie, crashed
        assert len(spotrun_automations(client)) == 12
        names = _deployment_names(client)
        nightly = client.read_deployment_by_name("resilient-training/nightly-retraining")
    assert names == set(stack.report.deployments) and len(names) == 7  # + recover-job and two examples
    assert [s.schedule.cron for s in nightly.schedules] == ["0 3 * * *"]  # type: ignore[union-attr]


def _deployment_names(client: Any) -> set[str]:
    flows = {f.id: f.name for f in client.read_flows()}
    return {f"{flows[d.flow_id]}/{d.name}" for d in client.read_deployments()}


def test_scheduler_creates_the_nightly_run(stack: Stack) -> None:
    dep_id = stack.report.deployments["resilient-training/nightly-retraining"]
    deadline = time.monotonic() + 90  # the scheduler service runs on its own loop, not on deploy
    with get_client(sync_client=True) as client:
        while True:
            only = DeploymentFilter(id=DeploymentFilterId(any_=[dep_id]))
            runs = client.read_flow_runs(deployment_filter=only)
            scheduled = sorted(r.expected_start_time for r in runs if r.state_name == "Scheduled")
            if scheduled or time.monotonic() > deadline:
                break
            time.sleep(1)
    assert scheduled, "the server's scheduler created no run of the nightly deployment in 90 s"
    first = scheduled[0]
    assert (first.hour, first.minute) == (3, 0) and first > datetime.now(UTC)
    assert runs[0].parameters["job"]["name"] == "charlm-nightly"
    # an operator resumes the sweeper; the next `spotrun deploy` (every `spotrun serve` runs one) keeps
    # that. (The queued nightly runs are not kept yet: the server deletes a deployment's future
    # auto-scheduled runs on any update, and `prefect deploy` updates every deployment.)
    with get_client(sync_client=True) as client:
        sweeper = client.read_deployment_by_name("sweep-instances/sweep-instances")
        (sched,) = sweeper.schedules
        client.update_deployment_schedule(sweeper.id, sched.id, active=True)
        try:
            deploy(RULES)
            again = client.read_deployment_by_name("sweep-instances/sweep-instances")
            assert [s.active for s in again.schedules] == [True]
        finally:
            client.update_deployment_schedule(sweeper.id, sched.id, active=False)


def test_storms_alert_once_per_job_and_two_restarts_do_not(stack: Stack) -> None:
    quiet, a, b = (f"{n}-{uuid.uuid4().hex[:6]}" for n in ("quiet", "storm-a", "storm-b"))
    seed_restarts(stack, quiet, 2)  # first: its events are evaluated before the storms fire
    seed_restarts(stack, a, 3)
    seed_restarts(stack, b, 4)  # the 4th restart falls in the same window: no second alert
    assert [r.state_name for r in alert_runs(a)] == ["Completed"]
    assert [r.state_name for r in alert_runs(b)] == ["Completed"]
    msg_a, msg_b = messages_about(stack, a), messages_about(stack, b)
    assert len(msg_a) == 1 and len(msg_b) == 1
    assert messages_about(stack, quiet) == [] and alert_runs(quiet, timeout_s=0) == []
    body = json.dumps(msg_a[0])
    # the checkpoint comes from whichever restart event crossed the threshold (the server may evaluate
    # events that occurred within microseconds in either order)
    for expected in (
        a,
        "3",
        "spot notice 1 (SIGTERM)",
        "spot notice 3",
        "reclaimed by the spot market",
        "/tmp/store/step-0000000",
        "75",
        "/runs/flow-run/",
    ):
        assert expected in body, f"{expected!r} missing from the Slack message: {body[:2000]}"
    assert msg_a[0]["blocks"][0]["type"] == "header"
    with stack.store() as store:
        sent = store.alerts(job=a)
    assert [(r.kind, r.status) for r in sent] == [("restart-storm", AlertStatus.SENT)]


def test_rate_limited_alert_is_delivered_once(stack: Stack) -> None:
    name = f"ratelimited-{uuid.uuid4().hex[:6]}"
    before = len(stack.slack.requests)
    stack.slack.script((429, {"Retry-After": "0"}, "rate_limited"))
    seed_restarts(stack, name, 3)
    assert [r.state_name for r in alert_runs(name)] == ["Completed"]
    assert len(messages_about(stack, name)) == 1
    statuses = [r["status"] for r in stack.slack.requests[before:]]
    assert statuses == [429, 200]


def test_gave_up_alerts_at_once_with_the_reason(stack: Stack) -> None:
    name = f"gaveup-{uuid.uuid4().hex[:6]}"
    seed_restarts(stack, name, 1)  # one restart: far from a storm
    reason = "gave up after 2 errors (budget 2): RuntimeError: injected failure at step 30"
    report.emit(report.JOB_GAVE_UP, name, attempts=2, checkpoint="", flow_run_id="", reason=reason)
    flush_to_api()
    runs = alert_runs(name)
    assert [(r.parameters["kind"], r.state_name) for r in runs] == [("gave-up", "Completed")]
    (message,) = messages_about(stack, name)
    assert "gave up" in message["text"] and "injected failure at step 30" in json.dumps(message)


def test_a_resume_mismatch_alerts_once_naming_the_attempt_and_the_difference(stack: Stack) -> None:
    """The event as the run log emits it (tests/integration/test_tracking.py makes a real one); an
    `exact` verdict about another job alerts nobody."""
    name, fine = f"mismatch-{uuid.uuid4().hex[:6]}", f"exact-{uuid.uuid4().hex[:6]}"
    check = {
        "attempt": 2,
        "method": "replay",
        "resumed_from": 50,
        "steps": 10,
        "span": "steps 51-60",
        "first_diff": 53,
        "diff": "step 53: loss 0.6931 before the reclaim, 0.6874 after",
        "max_rel": 0.0083,
        "detail": "10 step(s) computed twice (steps 51-60): step 53 differs",
        "checkpoint": "/tmp/store/step-0000000050",
        "flow_run_id": str(uuid.uuid4()),
    }
    for job_name, verdict in ((fine, "exact"), (name, "mismatch")):
        labels = {report.VERDICT_LABEL: verdict}
        report.emit_labeled(report.RESUME_CHECKED, job_name, labels, {**check, "verdict": verdict})
    flush_to_api()
    assert [(r.parameters["kind"], r.state_name) for r in alert_runs(name)] == [
        ("resume-mismatch", "Completed")
    ]
    (message,) = messages_about(stack, name)
    body = json.dumps(message)
    assert "attempt 2 resumed with different results" in message["text"]
    for expected in (
        "steps 51-60",
        "step 53: loss 0.6931 before the reclaim, 0.6874 after",
        "/tmp/store/step-0000000050",
        "/runs/flow-run/",
    ):
        assert expected in body, f"{expected!r} missing from the Slack message: {body[:2000]}"
    assert messages_about(stack, fine) == [] and alert_runs(fine, timeout_s=0) == []
    with stack.store() as store:
        sent = store.alerts(job=name)
    assert [(r.kind, r.status) for r in sent] == [("resume-mismatch", AlertStatus.SENT)]
    assert sent[0].dedup_key.startswith(f"resume-mismatch:{name}:") and sent[0].dedup_key.endswith(":2")


UNSIGNED = "cannot verify: not signed (SPOTRUN_MANIFEST_KEY is set here)"


def _check(job_name: str, sink: PrefectSink) -> None:
    for step in (20, 10):  # newest first, as tasks/control/checkpoints.py reports them
        sink.event(CHECKPOINT_UNVERIFIED, job_name, {"step": step, "problem": UNSIGNED})


@flow(name="integrity-check-stand-in")
def _unverified_checkpoints(job_name: str) -> None:
    """Two checkpoints the controller cannot verify, reported as the training flow's check-checkpoints
    step reports them: PrefectSink.event inside that step's task run."""
    sink = PrefectSink()
    sink.step("check-checkpoints", _check, job_name, sink)


def test_checkpoints_that_cannot_be_verified_alert_once_with_the_fix(stack: Stack) -> None:
    name = f"unverified-{uuid.uuid4().hex[:6]}"
    state = _unverified_checkpoints(name, return_state=True)
    flush_to_api()
    runs = alert_runs(name)
    assert [(r.parameters["kind"], r.state_name) for r in runs] == [("cannot-verify", "Completed")]
    (message,) = messages_about(stack, name)  # two checkpoints, one alert
    assert f"{name} has a checkpoint it cannot verify (step " in message["text"], message["text"]
    body = json.dumps(message)
    reporter = f"/runs/flow-run/{state.state_details.flow_run_id}"  # the run whose check found them
    for expected in (
        UNSIGNED,
        "nothing quarantined or deleted",
        "the same SPOTRUN_MANIFEST_KEY",
        "SPOTRUN_MANIFEST_KEYS_OLD",
        reporter,
    ):
        assert expected in body, f"{expected!r} missing from the Slack message: {body[:2000]}"
    with stack.store() as store:
        sent = store.alerts(job=name)
    assert [(r.kind, r.status) for r in sent] == [("cannot-verify", AlertStatus.SENT)]


@pytest.fixture(scope="module")
def slack_down_run(stack: Stack, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """A real training flow run (3 preemptions) while the Slack webhook answers nothing."""
    dead = f"http://127.0.0.1:{free_port()}/services/T/B/X"
    Secret(value=dead).save(WEBHOOK_SECRET, overwrite=True)
    try:
        spec = job(
            tmp_path_factory.mktemp("down"),
            name=f"down-{uuid.uuid4().hex[:6]}",
            total_steps=1500,
            args={"hidden": 64},
        )
        state = run_flow(spec, schedule((0.3, True), (0.3, False), (0.3, True)))
        flush_to_api()
        runs = alert_runs(spec.name, count=2)  # the storm and the recovery note
        yield spec, state, runs
    finally:
        Secret(value=stack.slack.url).save(WEBHOOK_SECRET, overwrite=True)


def test_slack_down_is_recorded_and_training_unaffected(stack: Stack, slack_down_run: Any) -> None:
    spec, state, runs = slack_down_run
    assert state.is_completed(), state.message
    kinds = {r.parameters["kind"]: r.state_name for r in runs}
    # the recovery note has no alert to follow up (the storm's never went out): it stays quiet
    assert kinds == {"restart-storm": "Failed", "recovered": "Completed"}
    with stack.store() as store:
        rows = store.alerts(job=spec.name, kind="restart-storm")
    # the first try and its one retry, each recorded failed with the reason
    assert [r.status for r in rows] == [AlertStatus.FAILED, AlertStatus.FAILED]
    assert all(r.error for r in rows)
    assert messages_about(stack, spec.name) == []
    # the progress artifact ends at 100% on a completed run (the UI's list card shows no number)
    with get_client(sync_client=True) as client:
        arts = client.read_artifacts(
            artifact_filter=ArtifactFilter(
                key=ArtifactFilterKey(any_=[report.artifact_key(spec.name, "progress")])
            ),
            flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[state.state_details.flow_run_id])),
        )
    assert [a.data for a in arts] == [100.0]


@pytest.mark.skipif(chromium_missing() is not None, reason=str(chromium_missing()))
def test_ui_shows_the_job_form_and_the_attempts_table(
    stack: Stack, slack_down_run: Any, tmp_path: Path
) -> None:
    spec, state, _ = slack_down_run
    out = Path(SCREENSHOTS) if SCREENSHOTS else tmp_path
    dep_id = stack.report.deployments["resilient-training/resilient-training"]
    ui = stack.server.api_url.removesuffix("/api")
    shots = screenshots(ui, str(dep_id), str(state.state_details.flow_run_id), out, auth=stack.server.auth)
    form = shots["deployment-form"].text
    for field in ("Name", "Recipe", "Total Steps", "Batch Size", "Checkpoint", "Storage", "Every Steps"):
        assert field in form, f"the deployment form shows no {field!r} field"
    table = shots["attempts-table"].text
    assert "preempted" in table and "resumed from" in table and "lost steps" in table
    assert shots["flow-run-artifacts"].text.count(f"attempts of {spec.name}") == 1  # one card, updated
    assert "scratch" in table and "4" in table  # the final version: all four attempts
    provider = shots["provider-choice"].text
    assert "Local Provider Config" in provider or "LocalProviderConfig" in provider, provider[:2000]
    assert "Heartbeat Timeout S" in provider  # the chosen provider's own form, not a JSON editor
    assert shots["timeline"].image_loaded, "the summary's timeline image did not render"
    assert all(s.png.stat().st_size > 20_000 for s in shots.values())  # a blank page is ~6 KB


def test_serve_deploys_runs_a_worker_and_stops_on_sigterm(stack: Stack, tmp_path: Path) -> None:
    env = {**os.environ, "SPOTRUN_HOME": str(tmp_path), "PYTHONPATH": str(Path(__file__).parents[2])}
    cmd = [
        sys.executable,
        "-m",
        "spotrun.cli",
        "serve",
        "--poll",
        "1",
        "--alert-retries",
        "1",
        "--alert-retry-delay",
        "1",
    ]  # the module's rules: nothing changes on the server
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            if "Ctrl-C stops it" in line:
                break
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0, "".join(lines)
    finally:
        if proc.poll() is None:
            proc.kill()
    out = "".join(lines) + (proc.stdout.read() if proc.stdout else "")
    assert "resilient-training/nightly-retraining" in out and "unchanged" in out, out
    assert "worker spotrun-" in out and "stopping the worker" in out, out
