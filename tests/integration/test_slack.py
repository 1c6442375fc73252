"""Slack delivery against a real HTTP server on 127.0.0.1 (pytest-httpserver), and `raise_alert` end to
end with a SQLite history: what is sent, retried, refused, deduplicated and recorded.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from pytest_httpserver import HTTPServer

from spotrun.tasks.alerts import (
    AlertKind,
    AlertRequest,
    AlertStatus,
    SlackMessage,
    SlackTarget,
    deliver,
    raise_alert,
)
from spotrun.tasks.decisions.attempts import AttemptRecord, Outcome
from spotrun.tasks.history import HistoryStore, JobStatus

HOOK = "/services/T000/B000/s3cretPath"
FAST = 0.01  # seconds between retries of a 5xx or a refused connection
MESSAGE = SlackMessage(
    text="spotrun: digits restarted 3 times in 1 h",
    blocks=[{"type": "section", "text": {"type": "mrkdwn", "text": "*digits* &amp; friends"}}],
)
JSON_HEADERS = {"Content-Type": "application/json;charset=utf-8"}


def webhook(httpserver: HTTPServer) -> SlackTarget:
    return SlackTarget(webhook_url=httpserver.url_for(HOOK))


def bot(httpserver: HTTPServer, channel: str = "#training") -> SlackTarget:
    return SlackTarget(token="xoxb-test-token", channel=channel, api_url=httpserver.url_for("/api/"))


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])  # nothing listens once the socket is closed


# -- the webhook ----------------------------------------------------------------------------------


def test_webhook_posts_the_blocks(httpserver: HTTPServer) -> None:
    httpserver.expect_request(
        HOOK, method="POST", json={"text": MESSAGE.text, "blocks": MESSAGE.blocks}, headers=JSON_HEADERS
    ).respond_with_data("ok")
    d = deliver(webhook(httpserver), MESSAGE)
    assert (d.ok, d.status, d.attempts, d.error, d.channel) == (True, 200, 1, "", "slack-webhook")
    httpserver.check_assertions()
    assert len(httpserver.log) == 1


def test_webhook_429_waits_and_is_delivered_once(httpserver: HTTPServer) -> None:
    httpserver.expect_ordered_request(HOOK, method="POST").respond_with_data(
        "rate_limited", status=429, headers={"Retry-After": "0"}
    )
    httpserver.expect_ordered_request(HOOK, method="POST").respond_with_data("ok")
    d = deliver(webhook(httpserver), MESSAGE)
    assert (d.ok, d.status, d.attempts) == (True, 200, 2)
    assert len(httpserver.log) == 2
    httpserver.check_assertions()


def test_webhook_500_is_retried(httpserver: HTTPServer) -> None:
    httpserver.expect_ordered_request(HOOK).respond_with_data("internal_error", status=500)
    httpserver.expect_ordered_request(HOOK).respond_with_data("ok")
    d = deliver(webhook(httpserver), MESSAGE, retry_interval_s=FAST)
    assert (d.ok, d.status, d.attempts) == (True, 200, 2)
    assert len(httpserver.log) == 2


def test_webhook_500_until_the_retries_run_out(httpserver: HTTPServer) -> None:
    httpserver.expect_request(HOOK).respond_with_data("internal_error", status=500)
    d = deliver(webhook(httpserver), MESSAGE, retries=2, retry_interval_s=FAST)
    assert (d.ok, d.status, d.attempts) == (False, 500, 3)
    assert d.error == "webhook answered HTTP 500 internal_error"
    assert len(httpserver.log) == 3


def test_webhook_revoked_says_what_to_do_and_is_not_retried(httpserver: HTTPServer) -> None:
    httpserver.expect_request(HOOK).respond_with_data("no_service", status=404)
    d = deliver(webhook(httpserver), MESSAGE, retry_interval_s=FAST)
    assert (d.ok, d.status, d.attempts) == (False, 404, 1)
    assert "no_service" in d.error and "SPOTRUN_SLACK_WEBHOOK_URL" in d.error
    assert "s3cret" not in d.error


def test_webhook_endpoint_down_returns_a_failed_delivery() -> None:
    target = SlackTarget(webhook_url=f"http://127.0.0.1:{closed_port()}{HOOK}")
    started = time.monotonic()
    d = deliver(target, MESSAGE, retries=1, retry_interval_s=FAST, timeout_s=2)
    assert time.monotonic() - started < 5
    assert (d.ok, d.status, d.attempts, d.channel) == (False, None, 2, "slack-webhook")
    assert "Connection refused" in d.error and "\n" not in d.error
    assert "s3cret" not in d.error


# -- the Web API with a bot token -----------------------------------------------------------------


def test_bot_token_posts_to_the_channel(httpserver: HTTPServer) -> None:
    httpserver.expect_request(
        "/api/chat.postMessage", method="POST", headers={"Authorization": "Bearer xoxb-test-token"}
    ).respond_with_json({"ok": True, "channel": "C0123", "ts": "1700000000.000100"})
    d = deliver(bot(httpserver), MESSAGE)
    assert (d.ok, d.status, d.attempts, d.channel) == (True, 200, 1, "slack-api")
    httpserver.check_assertions()
    (request, _), *_ = httpserver.log
    assert request.get_json() == {"channel": "#training", "text": MESSAGE.text, "blocks": MESSAGE.blocks}


def test_bot_429_then_ok(httpserver: HTTPServer) -> None:
    httpserver.expect_ordered_request("/api/chat.postMessage").respond_with_json(
        {"ok": False, "error": "ratelimited"}, status=429, headers={"Retry-After": "0"}
    )
    httpserver.expect_ordered_request("/api/chat.postMessage").respond_with_json({"ok": True, "ts": "1.2"})
    d = deliver(bot(httpserver), MESSAGE)
    assert (d.ok, d.attempts) == (True, 2)


def test_bot_500_until_the_retries_run_out(httpserver: HTTPServer) -> None:
    httpserver.expect_request("/api/chat.postMessage").respond_with_data("internal_error", status=500)
    d = deliver(bot(httpserver), MESSAGE, retries=2, retry_interval_s=FAST)
    assert (d.ok, d.status, d.attempts) == (False, 500, 3)
    assert d.error.startswith("Slack API answered HTTP 500: ") and d.error.endswith("internal_error")
    assert len(httpserver.log) == 3


@pytest.mark.parametrize(
    ("error", "fix"),
    [
        ("channel_not_found", "no channel #nope the bot can see: check SPOTRUN_SLACK_CHANNEL"),
        ("not_in_channel", "/invite"),
        ("invalid_auth", "SPOTRUN_SLACK_TOKEN"),
        ("not_authed", "SPOTRUN_SLACK_TOKEN"),
    ],
)
def test_bot_errors_say_the_fix(httpserver: HTTPServer, error: str, fix: str) -> None:
    httpserver.expect_request("/api/chat.postMessage").respond_with_json({"ok": False, "error": error})
    d = deliver(bot(httpserver, channel="#nope"), MESSAGE, retry_interval_s=FAST)
    assert (d.ok, d.status, d.attempts, d.channel) == (False, 200, 1, "slack-api")
    assert d.error.startswith(f"Slack API error {error} (HTTP 200): ")
    assert fix in d.error and "\n" not in d.error and "xoxb-test-token" not in d.error


def test_bot_endpoint_down_returns_a_failed_delivery() -> None:
    target = SlackTarget(
        token="xoxb-test-token", channel="#c", api_url=f"http://127.0.0.1:{closed_port()}/api/"
    )
    d = deliver(target, MESSAGE, retries=1, retry_interval_s=FAST, timeout_s=2)
    assert (d.ok, d.status, d.attempts) == (False, None, 2)
    assert "Connection refused" in d.error and "xoxb" not in d.error


# -- raise_alert end to end -----------------------------------------------------------------------


@pytest.fixture
def store(tmp_path: Path) -> Iterator[HistoryStore]:
    with HistoryStore.open(f"sqlite:///{tmp_path / 'history.db'}") as s:
        yield s


def storm_history(store: HistoryStore, n: int = 3) -> str:
    """A job run of `digits` with `n` preemptions in the last few minutes; returns its id."""
    run = store.start_job_run(
        "digits", "sha256:abc", "flow-run-1", storage_uri="file:///tmp/ckpt/digits", provider="local"
    )
    now = time.time()
    for i in range(1, n + 1):
        end = now - 60 * (n + 1 - i)
        store.record_attempt(
            run,
            AttemptRecord(
                attempt=i,
                worker_id=f"local-{i}",
                provider="local",
                started_at=end - 50,
                ended_at=end,
                outcome=Outcome.PREEMPTED,
                cause=f"spot notice (SIGTERM) #{i}",
                log_tail=f"step {100 * i}\nKilled\n",
                lost_steps=5,
            ),
        )
    return run


def request(kind: AlertKind = AlertKind.RESTART_STORM, **kw: object) -> AlertRequest:
    base: dict[str, object] = dict(
        kind=kind,
        job="digits",
        window_s=3600,
        threshold=3,
        checkpoint="file:///tmp/ckpt/digits/step-00000300",
        flow_run_url="http://127.0.0.1:4200/runs/flow-run/abc",
        trigger="event-1",
    )
    return AlertRequest(**(base | kw))  # type: ignore[arg-type]


def test_a_storm_is_sent_once(httpserver: HTTPServer, store: HistoryStore) -> None:
    run = storm_history(store)
    httpserver.expect_request(HOOK, method="POST").respond_with_data("ok")
    first = raise_alert(store, request(), webhook(httpserver))
    assert first.status is AlertStatus.SENT and first.key.startswith("restart-storm:digits:")
    assert first.delivery is not None and first.delivery.attempts == 1
    assert len(httpserver.log) == 1
    sent = httpserver.log[0][0].get_json()
    assert sent["text"] == first.message.text
    assert "digits restarted 3 times in 1 h" in sent["text"] and "spot notice (SIGTERM) #3" in sent["text"]
    assert sent["blocks"] == first.message.blocks

    again = raise_alert(store, request(trigger="event-2"), webhook(httpserver))
    assert (again.status, again.key, again.delivery) == (AlertStatus.SUPPRESSED, first.key, None)
    assert "already announced" in again.reason
    assert len(httpserver.log) == 1

    rows = store.alerts("digits")
    assert [(r.status, r.dedup_key, r.trigger) for r in rows] == [
        (AlertStatus.SENT, first.key, "event-1"),
        (AlertStatus.SUPPRESSED, first.key, "event-2"),
    ]
    assert (rows[0].channel, rows[0].http_status, rows[0].job_run_id, rows[0].kind) == (
        "slack-webhook",
        200,
        run,
        "restart-storm",
    )
    assert rows[0].message == first.message.text


def test_slack_down_is_recorded_and_a_later_try_sends(httpserver: HTTPServer, store: HistoryStore) -> None:
    storm_history(store)
    target = webhook(httpserver)
    httpserver.expect_request(HOOK, method="POST").respond_with_data("ok")
    httpserver.stop()
    try:
        failed = raise_alert(store, request(), target, retries=1, retry_interval_s=FAST)
    finally:
        httpserver.start()  # the same port: the same webhook URL answers again
    assert failed.status is AlertStatus.FAILED
    assert failed.delivery is not None and "Connection refused" in failed.delivery.error

    sent = raise_alert(store, request(), target)
    assert (sent.status, sent.key) == (AlertStatus.SENT, failed.key)  # the retry keeps the storm's key
    assert len(httpserver.log) == 1
    rows = store.alerts("digits", kind="restart-storm")
    assert [(r.status, r.http_status) for r in rows] == [(AlertStatus.FAILED, None), (AlertStatus.SENT, 200)]
    assert "Connection refused" in rows[0].error


def test_no_slack_logs_the_alert_as_markdown(store: HistoryStore) -> None:
    storm_history(store)
    result = raise_alert(store, request(), None)
    assert (result.status, result.delivery) == (AlertStatus.LOGGED, None)
    assert result.markdown.startswith("### spotrun: digits restarted 3 times in 1 h")
    assert "| 3 |" in result.markdown and "Killed" in result.markdown
    (row,) = store.alerts("digits")
    assert (row.status, row.channel) == (AlertStatus.LOGGED, "log")
    assert raise_alert(store, request(), None).status is AlertStatus.SUPPRESSED  # logged counts as told


def test_gave_up_then_recovered_in_the_next_run(httpserver: HTTPServer, store: HistoryStore) -> None:
    httpserver.expect_request(HOOK, method="POST").respond_with_data("ok")
    target = webhook(httpserver)
    run = storm_history(store, n=4)
    store.finish_job_run(run, JobStatus.FAILED, "restart budget spent")
    gave_up = raise_alert(store, request(AlertKind.GAVE_UP, reason="restart budget spent"), target)
    assert (gave_up.status, gave_up.key) == (AlertStatus.SENT, f"gave-up:digits:{run}")
    assert "gave up after 4 attempts: restart budget spent" in gave_up.message.text
    assert raise_alert(store, request(AlertKind.GAVE_UP), target).status is AlertStatus.SUPPRESSED

    # The next run restarts quietly and completes: nothing was announced during it.
    store.start_job_run(
        "digits", "sha256:abc", "flow-run-2", storage_uri="file:///tmp/ckpt/digits", provider="local"
    )
    quiet = raise_alert(store, request(AlertKind.RECOVERED), target)
    assert (quiet.status, quiet.reason) == (AlertStatus.SUPPRESSED, "no alert to recover from")

    storm = raise_alert(store, request(), target)
    recovered = raise_alert(store, request(AlertKind.RECOVERED), target)
    assert (storm.status, recovered.status) == (AlertStatus.SENT, AlertStatus.SENT)
    assert len(httpserver.log) == 3


def test_history_down_still_sends(httpserver: HTTPServer, tmp_path: Path) -> None:
    blocker = tmp_path / "blocker"  # a file where the database's directory must go
    blocker.write_text("")
    httpserver.expect_request(HOOK, method="POST").respond_with_data("ok")
    store = HistoryStore.open(f"sqlite:///{blocker / 'history.db'}")
    result = raise_alert(store, request(), webhook(httpserver))
    assert result.status is AlertStatus.SENT and len(httpserver.log) == 1
    assert "without the history" in result.reason
    assert "restarted at least 3 times in 1 h" in result.message.text
    assert "restart history unavailable" in str(result.message.blocks)
    assert store.pending == 1  # the record waits for the database

    blocker.unlink()
    assert store.flush(timeout_s=5)
    assert [r.status for r in store.alerts("digits")] == [AlertStatus.SENT]
    store.close()
