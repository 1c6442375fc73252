"""The alert domain without a network: dedup decisions (a table), message content and bounds, settings."""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from spotrun.tasks.alerts import (
    Action,
    AlertContext,
    AlertKind,
    PromotionFacts,
    ResumeFacts,
    SlackConfigError,
    SlackTarget,
    build_message,
    decide,
    target_from_env,
    to_markdown,
)
from spotrun.tasks.alerts.message import human_duration, slack_escape
from spotrun.tasks.alerts.service import AlertRequest, raise_alert
from spotrun.tasks.decisions.attempts import Outcome
from spotrun.tasks.history import AlertRow, AlertStatus, AttemptRow, HistoryStore
from spotrun.trainer.errors import ConfigError

T0 = 1_700_000_000.0  # 2023-11-14T22:13:20Z
NOW = T0 + 10_000
RUN_START = NOW - 5000
HOUR = 3600.0
STORM, GAVE_UP, RECOVERED = AlertKind.RESTART_STORM, AlertKind.GAVE_UP, AlertKind.RECOVERED
MISMATCH, UNVERIFIED, DISK = AlertKind.RESUME_MISMATCH, AlertKind.CANNOT_VERIFY, AlertKind.DISK_FULL
SENT, FAILED, LOGGED, SUPPRESSED = (
    AlertStatus.SENT,
    AlertStatus.FAILED,
    AlertStatus.LOGGED,
    AlertStatus.SUPPRESSED,
)
NEW_STORM_KEY = "restart-storm:digits:20231115T010000Z"  # opened at NOW
PROMOTION, MISSED, RUN_FAILED = AlertKind.PROMOTION, AlertKind.MISSED_RUN, AlertKind.RUN_FAILED
ABOUT_RUNS = (PROMOTION, MISSED, RUN_FAILED)


# -- decide ---------------------------------------------------------------------------------------


def alert(kind: AlertKind, key: str, status: AlertStatus, ago_s: float, *, job: str = "digits") -> AlertRow:
    return AlertRow(
        id=0,
        dedup_key=key,
        kind=str(kind),
        job=job,
        job_run_id=None,
        status=status,
        channel="slack-webhook",
        http_status=None,
        error="",
        message="",
        trigger="",
        created_at=NOW - ago_s,
    )


OLD = "restart-storm:digits:20231114T230000Z"  # a storm opened earlier
GAVE_UP_1, RECOVERED_1 = "gave-up:digits:run-1", "recovered:digits:run-1"
SEND, SUPPRESS = Action.SEND, Action.SUPPRESS
CHARLM_STORM = alert(STORM, "restart-storm:charlm:x", SENT, 60, job="charlm")
RUN_0_GAVE_UP = alert(GAVE_UP, "gave-up:digits:run-0", SENT, 30)
NEW_UNVERIFIED_KEY = "cannot-verify:digits:20231115T010000Z"  # opened at NOW
OLD_UNVERIFIED = "cannot-verify:digits:20231115T003000Z"
NEW_DISK_KEY = "disk-full:digits:20231115T010000Z"  # opened at NOW
OLD_DISK = "disk-full:digits:20231115T003000Z"

DECISIONS: list[tuple[str, AlertKind, str | None, list[AlertRow], Action, str, str]] = [
    # (case, kind, job_run_id, previous alerts, action, key, the reason contains)
    ("first storm", STORM, "run-1", [], SEND, NEW_STORM_KEY, "new storm"),
    ("storm sent 10 min ago", STORM, "run-1", [alert(STORM, OLD, SENT, 600)], SUPPRESS, OLD, "already"),
    ("storm logged 10 min ago", STORM, "run-1", [alert(STORM, OLD, LOGGED, 600)], SUPPRESS, OLD, "already"),
    ("storm sent 2 h ago", STORM, "run-1", [alert(STORM, OLD, SENT, 7200)], SEND, NEW_STORM_KEY, "new storm"),
    ("storm failed: keeps key", STORM, "run-1", [alert(STORM, OLD, FAILED, 60)], SEND, OLD, "not delivered"),
    (
        "storm failed then sent",
        STORM,
        "run-1",
        [alert(STORM, OLD, FAILED, 120), alert(STORM, OLD, SENT, 60)],
        SUPPRESS,
        OLD,
        "already",
    ),
    ("another job's storm", STORM, "run-1", [CHARLM_STORM], SEND, NEW_STORM_KEY, "new"),
    ("give-up is no storm", STORM, "run-1", [RUN_0_GAVE_UP], SEND, NEW_STORM_KEY, "new"),
    ("first give-up", GAVE_UP, "run-1", [], SEND, GAVE_UP_1, "first"),
    ("give-up sent", GAVE_UP, "run-1", [alert(GAVE_UP, GAVE_UP_1, SENT, 30)], SUPPRESS, GAVE_UP_1, "already"),
    ("earlier run's give-up", GAVE_UP, "run-1", [RUN_0_GAVE_UP], SEND, GAVE_UP_1, "first"),
    ("give-up failed", GAVE_UP, "run-1", [alert(GAVE_UP, GAVE_UP_1, FAILED, 30)], SEND, GAVE_UP_1, "first"),
    ("give-up, run unknown", GAVE_UP, None, [], SEND, "gave-up:digits:20231115T010000Z", "first"),
    ("nothing to recover from", RECOVERED, "run-1", [], SUPPRESS, RECOVERED_1, "no alert to recover from"),
    ("recovered after a storm", RECOVERED, "run-1", [alert(STORM, OLD, SENT, 600)], SEND, RECOVERED_1, OLD),
    ("after a logged storm", RECOVERED, "run-1", [alert(STORM, OLD, LOGGED, 600)], SEND, RECOVERED_1, OLD),
    ("before the run", RECOVERED, "run-1", [alert(STORM, OLD, SENT, 6000)], SUPPRESS, RECOVERED_1, "no"),
    ("not delivered", RECOVERED, "run-1", [alert(STORM, OLD, FAILED, 600)], SUPPRESS, RECOVERED_1, "no"),
    ("suppressed", RECOVERED, "run-1", [alert(STORM, OLD, SUPPRESSED, 60)], SUPPRESS, RECOVERED_1, "no"),
    (
        "recovered already sent",
        RECOVERED,
        "run-1",
        [alert(STORM, OLD, SENT, 600), alert(RECOVERED, RECOVERED_1, SENT, 10)],
        SUPPRESS,
        RECOVERED_1,
        "already",
    ),
    ("another job's storm ended", RECOVERED, "run-1", [CHARLM_STORM], SUPPRESS, RECOVERED_1, "no alert"),
    # cannot verify: once a window per job, whichever job run, checkpoint or check asks
    ("first unverified", UNVERIFIED, "run-1", [], SEND, NEW_UNVERIFIED_KEY, "new unverifiable checkpoint"),
    ("unverified sent 10 min ago", UNVERIFIED, "run-1", [alert(UNVERIFIED, OLD_UNVERIFIED, SENT, 600)],
     SUPPRESS, OLD_UNVERIFIED, "already"),
    ("unverified logged 10 min ago", UNVERIFIED, "run-1", [alert(UNVERIFIED, OLD_UNVERIFIED, LOGGED, 600)],
     SUPPRESS, OLD_UNVERIFIED, "already"),
    ("unverified, another job run", UNVERIFIED, "run-2", [alert(UNVERIFIED, OLD_UNVERIFIED, SENT, 600)],
     SUPPRESS, OLD_UNVERIFIED, "already"),
    ("unverified, run unknown", UNVERIFIED, None, [alert(UNVERIFIED, OLD_UNVERIFIED, SENT, 600)],
     SUPPRESS, OLD_UNVERIFIED, "already"),
    ("unverified sent 2 h ago", UNVERIFIED, "run-1", [alert(UNVERIFIED, OLD_UNVERIFIED, SENT, 7200)],
     SEND, NEW_UNVERIFIED_KEY, "new"),
    ("unverified failed: keeps key", UNVERIFIED, "run-1", [alert(UNVERIFIED, OLD_UNVERIFIED, FAILED, 60)],
     SEND, OLD_UNVERIFIED, "not delivered"),
    ("a storm is no unverified", UNVERIFIED, "run-1", [alert(STORM, OLD, SENT, 60)], SEND, NEW_UNVERIFIED_KEY,
     "new"),
    ("another job's unverified", UNVERIFIED, "run-1",
     [alert(UNVERIFIED, "cannot-verify:charlm:x", SENT, 60, job="charlm")], SEND, NEW_UNVERIFIED_KEY, "new"),
    ("unverified is no storm", STORM, "run-1", [alert(UNVERIFIED, OLD_UNVERIFIED, SENT, 60)], SEND,
     NEW_STORM_KEY, "new storm"),
    ("nothing to recover from but unverified", RECOVERED, "run-1",
     [alert(UNVERIFIED, OLD_UNVERIFIED, SENT, 60)], SUPPRESS, RECOVERED_1, "no alert to recover from"),
    # disk full: once a window per job, however many checks find it
    ("first full disk", DISK, "run-1", [], SEND, NEW_DISK_KEY, "new full disk"),
    ("full disk sent 10 min ago", DISK, "run-1", [alert(DISK, OLD_DISK, SENT, 600)], SUPPRESS, OLD_DISK,
     "full disk already announced"),
    ("full disk logged 10 min ago", DISK, "run-1", [alert(DISK, OLD_DISK, LOGGED, 600)], SUPPRESS, OLD_DISK,
     "already"),
    ("full disk, another job run", DISK, "run-2", [alert(DISK, OLD_DISK, SENT, 600)], SUPPRESS, OLD_DISK,
     "already"),
    ("full disk sent 2 h ago", DISK, "run-1", [alert(DISK, OLD_DISK, SENT, 7200)], SEND, NEW_DISK_KEY, "new"),
    ("full disk failed: keeps key", DISK, "run-1", [alert(DISK, OLD_DISK, FAILED, 60)], SEND, OLD_DISK,
     "not delivered"),
    ("unverified is no full disk", DISK, "run-1", [alert(UNVERIFIED, OLD_UNVERIFIED, SENT, 60)], SEND,
     NEW_DISK_KEY, "new"),
    ("another job's full disk", DISK, "run-1", [alert(DISK, "disk-full:charlm:x", SENT, 60, job="charlm")],
     SEND, NEW_DISK_KEY, "new"),
    ("full disk is no unverified", UNVERIFIED, "run-1", [alert(DISK, OLD_DISK, SENT, 60)], SEND,
     NEW_UNVERIFIED_KEY, "new"),
    ("nothing to recover from but a full disk", RECOVERED, "run-1", [alert(DISK, OLD_DISK, SENT, 60)],
     SUPPRESS, RECOVERED_1, "no alert to recover from"),
]  # fmt: skip  # one case per line: a table


@pytest.mark.parametrize(
    ("kind", "run", "previous", "action", "key", "why"),
    [pytest.param(*case[1:], id=case[0]) for case in DECISIONS],
)
def test_decide(
    kind: AlertKind, run: str | None, previous: list[AlertRow], action: Action, key: str, why: str
) -> None:
    d = decide(kind, "digits", run, previous, window_s=HOUR, now=NOW, run_started_at=RUN_START)
    assert (d.action, d.key) == (action, key)
    assert why in d.reason


MISMATCH_2 = "resume-mismatch:digits:run-1:2"
MISMATCHES: list[tuple[str, str | None, int, list[AlertRow], Action, str, str]] = [
    # (case, job_run_id, attempt, previous alerts, action, key, the reason contains)
    ("first mismatch", "run-1", 2, [], SEND, MISMATCH_2, "attempt 2"),
    ("sent already", "run-1", 2, [alert(MISMATCH, MISMATCH_2, SENT, 30)], SUPPRESS, MISMATCH_2, "already"),
    ("logged already", "run-1", 2, [alert(MISMATCH, MISMATCH_2, LOGGED, 30)], SUPPRESS, MISMATCH_2,
     "already"),
    ("failed: retried", "run-1", 2, [alert(MISMATCH, MISMATCH_2, FAILED, 30)], SEND, MISMATCH_2, "first"),
    ("another attempt", "run-1", 3, [alert(MISMATCH, MISMATCH_2, SENT, 30)], SEND,
     "resume-mismatch:digits:run-1:3", "attempt 3"),
    ("a storm is no mismatch", "run-1", 2, [alert(STORM, OLD, SENT, 60)], SEND, MISMATCH_2, "first"),
    ("run unknown", None, 2, [], SEND, "resume-mismatch:digits:20231115T010000Z:2", "first"),
]  # fmt: skip  # one case per line: a table


@pytest.mark.parametrize(
    ("run", "attempt", "previous", "action", "key", "why"),
    [pytest.param(*case[1:], id=case[0]) for case in MISMATCHES],
)
def test_decide_resume_mismatch(
    run: str | None, attempt: int, previous: list[AlertRow], action: Action, key: str, why: str
) -> None:
    d = decide(MISMATCH, "digits", run, previous, window_s=HOUR, now=NOW, attempt=attempt)
    assert (d.action, d.key) == (action, key)
    assert why in d.reason


def test_a_mismatch_does_not_make_a_recovery_note() -> None:
    mismatch = [alert(MISMATCH, MISMATCH_2, SENT, 60)]
    d = decide(RECOVERED, "digits", "run-1", mismatch, window_s=HOUR, now=NOW, run_started_at=RUN_START)
    assert d.action is Action.SUPPRESS


def test_recovered_without_a_known_job_run_looks_back_one_window() -> None:
    recent, old = [alert(STORM, OLD, SENT, 600)], [alert(STORM, OLD, SENT, 7200)]
    assert decide(RECOVERED, "digits", None, recent, window_s=HOUR, now=NOW).action is Action.SEND
    assert decide(RECOVERED, "digits", None, old, window_s=HOUR, now=NOW).action is Action.SUPPRESS


# -- messages -------------------------------------------------------------------------------------


def attempt_row(n: int, ended_at: float, **kw: Any) -> AttemptRow:
    base: dict[str, Any] = dict(
        attempt=n,
        worker_id=f"local-{n}",
        provider="local",
        started_at=ended_at - 60,
        ended_at=ended_at,
        outcome=Outcome.PREEMPTED,
        cause="spot notice (SIGTERM), exited PREEMPTED",
        lost_steps=10 * n,
        job="digits",
        job_run_id="run-1",
    )
    return AttemptRow(**(base | kw))


def storm(**kw: Any) -> AlertContext:
    restarts = [
        attempt_row(1, NOW - 1800),
        attempt_row(2, NOW - 900, outcome=Outcome.CRASHED, cause="exit code 1: RuntimeError: CUDA OOM"),
        attempt_row(
            3,
            NOW - 60,
            outcome=Outcome.LOST,
            cause="no heartbeat for 120 s",
            log_tail="step 1200 loss 0.51\nstep 1210 loss 0.50\nKilled\n",
            error="worker vanished",
        ),
    ]
    base: dict[str, Any] = dict(
        kind=STORM,
        job="digits",
        restarts=restarts,
        window_s=HOUR,
        threshold=3,
        checkpoint="s3://ckpt/digits/step-00001200",
        flow_run_url="http://127.0.0.1:4200/runs/flow-run/abc",
        now=NOW,
        run_attempts=3,
    )
    return AlertContext(**(base | kw))


def texts(blocks: list[dict[str, Any]]) -> Iterator[tuple[str, str]]:
    """(where, text) of every text object in the blocks."""
    for i, b in enumerate(blocks):
        if "text" in b:
            yield f"{i}:{b['type']}", b["text"]["text"]
        for j, f in enumerate(b.get("fields", [])):
            yield f"{i}:field{j}", f["text"]
        for j, e in enumerate(b.get("elements", [])):
            if "text" in e:
                yield f"{i}:element{j}", e["text"] if isinstance(e["text"], str) else e["text"]["text"]


def fields(blocks: list[dict[str, Any]]) -> dict[str, str]:
    (section,) = [b for b in blocks if "fields" in b]
    return dict(f["text"].split("\n", 1) for f in section["fields"])


def test_storm_message_says_what_happened() -> None:
    msg = build_message(storm())
    assert msg.blocks[0] == {
        "type": "header",
        "text": {"type": "plain_text", "text": ":rotating_light: spotrun: digits restarted 3 times in 1 h"},
    }
    f = fields(msg.blocks)
    assert f["*Job*"] == "digits"
    assert f["*Restarts in window*"] == "3 in 1 h (threshold 3)"
    assert f["*Last failure*"].startswith("2023-11-15T00:59:00Z (lost, attempt 3)\n<!date^1700009940^{ago}|")
    assert f["*Last cause*"] == "no heartbeat for 120 s"
    assert f["*Resumed from*"] == "s3://ckpt/digits/step-00001200"
    assert f["*Lost steps in window*"] == "60"
    body = "\n".join(t for _, t in texts(msg.blocks))
    for line in (
        "• #1 `2023-11-15T00:30:00Z` *preempted*: spot notice (SIGTERM), exited PREEMPTED (lost 10 steps)",
        "• #2 `2023-11-15T00:45:00Z` *crashed*: exit code 1: RuntimeError: CUDA OOM (lost 20 steps)",
        "*Last log lines* (attempt 3)\n```\nstep 1200 loss 0.51\nstep 1210 loss 0.50\nKilled\n```",
    ):
        assert line in body
    assert msg.blocks[-1] == {
        "type": "actions",
        "elements": [
            {
                "type": "button",
                "text": {"type": "plain_text", "text": "Open flow run"},
                "url": "http://127.0.0.1:4200/runs/flow-run/abc",
            }
        ],
    }
    assert msg.text == (
        "spotrun: digits restarted 3 times in 1 h; last failure: lost: no heartbeat for 120 s"
    )


def test_log_falls_back_to_the_error_and_the_link_is_optional() -> None:
    ctx = storm(flow_run_url=None, checkpoint=None)
    ctx.restarts[-1].log_tail = ""
    msg = build_message(ctx)
    assert "```\nworker vanished\n```" in "\n".join(t for _, t in texts(msg.blocks))
    assert all(b["type"] != "actions" for b in msg.blocks)
    assert fields(msg.blocks)["*Resumed from*"] == "not known"


def test_gave_up_and_recovered_wording() -> None:
    gave_up = build_message(storm(kind=GAVE_UP, run_attempts=5, reason="restart budget (4) spent"))
    assert gave_up.blocks[0]["text"]["text"] == ":x: spotrun: digits gave up after 5 attempts"
    assert gave_up.text.startswith("spotrun: digits gave up after 5 attempts: restart budget (4) spent;")
    assert fields(gave_up.blocks)["*Reason*"] == "restart budget (4) spent"

    recovered = build_message(storm(kind=RECOVERED, run_attempts=4))
    assert recovered.blocks[0]["text"]["text"] == (
        ":white_check_mark: spotrun: digits recovered: completed after 3 restarts"
    )
    assert "Last log lines" not in str(recovered.blocks)
    assert "recovered: completed after 3 restarts" in to_markdown(storm(kind=RECOVERED, run_attempts=4))


def test_storm_without_restarts_on_record() -> None:
    msg = build_message(storm(restarts=[], note="restart history unavailable: counts may be incomplete"))
    assert msg.text == "spotrun: digits restarted at least 3 times in 1 h"
    assert [b["type"] for b in msg.blocks] == ["header", "section", "context", "actions"]
    assert "unavailable" in msg.blocks[2]["elements"][0]["text"]


def test_every_text_stays_within_slacks_limits() -> None:
    log = "".join(f"step {i} loss & <nan> ``` {'x' * (i % 300)}\n" for i in range(6000)) + "THE END"
    assert len(log) > 1_000_000
    restarts = [
        attempt_row(n, NOW - 3000 + 10 * n, cause="&<>" * 500 + f" cause {n}", log_tail=log)
        for n in range(1, 201)
    ]
    ctx = storm(restarts=restarts, job="j" * 255, checkpoint="s3://" + "c&" * 3000, reason="r" * 10_000)
    for kind in AlertKind:
        msg = build_message(AlertContext(**(vars(ctx) | {"kind": kind})))
        assert len(msg.blocks) < 50
        for where, text in texts(msg.blocks):
            assert len(text) < 3000, where
            assert "fields" not in where or len(text) < 2000, where
        assert len(msg.blocks[0]["text"]["text"]) <= 150
        assert len(msg.text) < 3000
        log_section = [t for _, t in texts(msg.blocks) if t.startswith("*Last log lines*")]
        if kind in (
            MISMATCH,
            UNVERIFIED,
            DISK,
            AlertKind.DEADLINE_AT_RISK,
            *ABOUT_RUNS,
        ):  # no restarts, no log
            assert not log_section and "earlier not shown" not in str(msg.blocks)
            continue
        if kind is not RECOVERED:  # a recovery shows no log
            assert log_section and log_section[0].endswith("THE END\n```")
            assert log_section[0].count("```") == 2  # the log's own fences cannot close the block
        assert "190 earlier not shown" in "\n".join(t for _, t in texts(msg.blocks))
    md = to_markdown(ctx)
    assert len(md) < 10_000 and "THE END" in md


def test_user_text_is_escaped() -> None:
    ctx = storm(
        job="a<b>&c",
        restarts=[
            attempt_row(
                1, NOW - 60, cause="<!channel> & <http://evil|click>", log_tail="if a < b && c > d:\n"
            ),
        ],
        checkpoint="file:///tmp/<x>",
    )
    msg = build_message(ctx)
    for where, text in texts(msg.blocks):
        if where.endswith("header"):
            continue  # plain_text: shown as written
        ours = re.sub(r"<!date\^\d+\^\{ago\}\|[^<>]*>", "", text)
        assert "<" not in ours and ">" not in ours, (where, text)
        assert not re.search(r"&(?!amp;|lt;|gt;)", ours), (where, text)
    body = "\n".join(t for _, t in texts(msg.blocks))
    assert "&lt;!channel&gt; &amp; &lt;http://evil|click&gt;" in body
    assert "if a &lt; b &amp;&amp; c &gt; d:" in body
    assert "a&lt;b&gt;&amp;c" in msg.text and "<!channel>" not in msg.text


def test_markdown_has_the_same_content() -> None:
    ctx = storm()
    ctx.restarts[-1].log_tail = "a ``` fence\nKilled"
    md = to_markdown(ctx)
    assert md.startswith("### spotrun: digits restarted 3 times in 1 h\n")
    for part in (
        "- **Restarts in window:** 3 in 1 h (threshold 3)",
        "- **Last failure:** 2023-11-15T00:59:00Z (lost, attempt 3)",
        "- **Resumed from:** s3://ckpt/digits/step-00001200",
        "- **Lost steps in window:** 60",
        "- **Flow run:** http://127.0.0.1:4200/runs/flow-run/abc",
        "| 2 | 2023-11-15T00:45:00Z | crashed | exit code 1: RuntimeError: CUDA OOM | 20 |",
        "````text\na ``` fence\nKilled\n````",
    ):
        assert part in md


CHECK = ResumeFacts(
    attempt=2,
    method="replay",
    resumed_from=50,
    steps=10,
    span="steps 51-60",
    first_diff=53,
    diff="step 53: loss 0.6931 before the reclaim, 0.6874 after",
    max_rel=0.0083,
    detail="10 step(s) computed twice (steps 51-60): step 53 differs, largest relative difference 0.0083",
)


def mismatch(**kw: Any) -> AlertContext:
    base: dict[str, Any] = dict(kind=MISMATCH, resume=CHECK, checkpoint="/store/digits/step-0000000050")
    return storm(**(base | kw))


MISMATCH_FIELDS: list[tuple[str, dict[str, Any], dict[str, str]]] = [
    # (case, context changes, fields expected)
    (
        "replay",
        {},
        {
            "*Job*": "digits",
            "*Attempt*": "2",
            "*Resumed from*": "/store/digits/step-0000000050",
            "*Steps compared*": "steps 51-60 (computed twice)",
            "*First difference*": "step 53: loss 0.6931 before the reclaim, 0.6874 after",
            "*Largest relative difference*": "0.0083",
        },
    ),
    (
        "continuity",
        {
            "resume": ResumeFacts(
                attempt=3,
                method="continuity",
                resumed_from=40,
                steps=1,
                span="step 41",
                first_diff=41,
                diff="step 41: learning rate at step 41 0.0005, scheduled 0.001",
            )
        },
        {
            "*Attempt*": "3",
            "*Steps compared*": "step 41 (the first step after the resume)",
            "*First difference*": "step 41: learning rate at step 41 0.0005, scheduled 0.001",
        },
    ),
    ("checkpoint not in the event", {"checkpoint": None}, {"*Resumed from*": "step 50"}),
    (
        "a check recorded before span and diff",
        {"resume": ResumeFacts(attempt=2, method="replay", resumed_from=50, steps=4, first_diff=52)},
        {"*Steps compared*": "4 steps (computed twice)", "*First difference*": "step 52"},
    ),
]


@pytest.mark.parametrize(("changes", "expected"), [pytest.param(*c[1:], id=c[0]) for c in MISMATCH_FIELDS])
def test_mismatch_message_names_the_attempt_the_steps_and_the_difference(
    changes: dict[str, Any], expected: dict[str, str]
) -> None:
    msg = build_message(mismatch(**changes))
    f = fields(msg.blocks)
    assert expected.items() <= f.items(), f
    attempt = expected.get("*Attempt*", "2")
    assert msg.blocks[0]["text"]["text"] == (
        f":warning: spotrun: digits attempt {attempt} resumed with different results (resume check: mismatch)"
    )
    assert [b["type"] for b in msg.blocks] == ["header", "section", "actions"]  # no restarts, no log


def test_mismatch_fallback_and_markdown() -> None:
    ctx = mismatch()
    assert build_message(ctx).text == (
        "spotrun: digits attempt 2 resumed with different results (resume check: mismatch): "
        "step 53: loss 0.6931 before the reclaim, 0.6874 after"
    )
    md = to_markdown(ctx)
    for part in (
        "- **Steps compared:** steps 51-60 (computed twice)",
        "- **Attempt:** 2",
        "- **Check:** 10 step(s) computed twice (steps 51-60): step 53 differs",
    ):
        assert part in md
    assert "Restarts in the last" not in md


def test_replay_verdict_names_the_span_and_the_first_differing_values() -> None:
    from spotrun.tasks.tracking.fidelity import Value, replay_verdict

    lost = {51: Value(0.5), 52: Value(0.25), 53: Value(0.125)}
    v = replay_verdict(lost, {**lost, 52: Value(0.3), 53: Value(0.2)}, rtol=1e-3)
    assert v is not None and (v.verdict, v.span) == ("mismatch", "steps 51-53")
    assert v.diff == "step 52: loss 0.25 before the reclaim, 0.3 after"


PROBLEM = "cannot verify: not signed (SPOTRUN_MANIFEST_KEY is set here)"
UNVERIFIED_TITLE = "spotrun: digits has a checkpoint it cannot verify (step 20): kept, not quarantined"


def unverified(**kw: Any) -> AlertContext:
    return storm(**({"kind": UNVERIFIED, "checkpoint": "step 20", "reason": PROBLEM} | kw))


def test_cannot_verify_says_nothing_was_quarantined_and_how_to_fix_it() -> None:
    msg = build_message(unverified())
    assert msg.blocks[0]["text"]["text"] == f":lock: {UNVERIFIED_TITLE}"
    assert msg.text == f"{UNVERIFIED_TITLE}: {PROBLEM}"
    f = fields(msg.blocks)
    assert (f["*Job*"], f["*Checkpoint*"], f["*Problem*"]) == ("digits", "step 20", PROBLEM)
    assert f["*Done*"].startswith("nothing quarantined or deleted")
    assert "the same SPOTRUN_MANIFEST_KEY" in f["*Fix*"] and "SPOTRUN_MANIFEST_KEYS_OLD" in f["*Fix*"]
    # the window's restarts are another story: neither they nor the last log are shown
    assert [b["type"] for b in msg.blocks] == ["header", "section", "actions"]
    md = to_markdown(unverified())
    assert md.startswith(f"### {UNVERIFIED_TITLE}\n")
    for part in (
        f"- **Problem:** {PROBLEM}",
        "- **Done:** nothing quarantined or deleted",
        "- **Fix:** give the workers and the controller the same SPOTRUN_MANIFEST_KEY",
    ):
        assert part in md
    assert "Restarts in the last" not in md and "Last log lines" not in md


def test_cannot_verify_is_told_once_a_window_and_recorded(tmp_path: Path) -> None:
    """Through raise_alert and a real SQLite history: two checkpoints, ten minutes apart, one alert."""
    request = AlertRequest(
        kind=UNVERIFIED, job="digits", window_s=HOUR, threshold=3, reason=PROBLEM, checkpoint="step 20"
    )
    with HistoryStore.open(f"sqlite:///{tmp_path / 'history.db'}") as store:
        first = raise_alert(store, request, None, now=NOW)
        second = raise_alert(store, replace(request, checkpoint="step 10"), None, now=NOW + 600)
        rows = [(r.kind, r.status, r.dedup_key) for r in store.alerts(job="digits")]
    assert (first.status, second.status) == (LOGGED, SUPPRESSED)
    assert first.markdown.startswith(f"### {UNVERIFIED_TITLE}\n")
    assert rows == [
        ("cannot-verify", LOGGED, NEW_UNVERIFIED_KEY),
        ("cannot-verify", SUPPRESSED, NEW_UNVERIFIED_KEY),
    ]

    blocker = tmp_path / "blocker"  # a file where the database's directory must go: the history is down
    blocker.write_text("")
    down = raise_alert(HistoryStore.open(f"sqlite:///{blocker / 'history.db'}"), request, None, now=NOW)
    assert down.status is LOGGED and "without the history" in down.reason
    assert "_alert history unavailable: this may repeat an earlier alert_" in down.markdown  # no counts


UNVERIFIED_GAPS: list[tuple[str, dict[str, Any], str, dict[str, str]]] = [
    # (case, context changes, the fallback text, fields expected)
    (
        "no step",
        {"checkpoint": None},
        f"spotrun: digits has a checkpoint it cannot verify: kept, not quarantined: {PROBLEM}",
        {"*Checkpoint*": "not known"},
    ),
    ("no problem", {"reason": ""}, UNVERIFIED_TITLE, {"*Problem*": "not known"}),
    (
        "a problem over lines",
        {"reason": "cannot verify:\n  signed with key id 'ab'"},
        f"{UNVERIFIED_TITLE}: cannot verify: signed with key id 'ab'",
        {"*Problem*": "cannot verify: signed with key id 'ab'"},
    ),
]


@pytest.mark.parametrize(
    ("changes", "text", "expected"), [pytest.param(*c[1:], id=c[0]) for c in UNVERIFIED_GAPS]
)
def test_cannot_verify_with_what_the_event_left_out(
    changes: dict[str, Any], text: str, expected: dict[str, str]
) -> None:
    msg = build_message(unverified(**changes))
    assert msg.text == text
    assert expected.items() <= fields(msg.blocks).items()


CACHE = "/home/ops/.spotrun/jobs/digits/flow-cache"
NO_SPACE = f"No space left on device under {CACHE}"
WHERE = f"{CACHE} on ctl-1"
DISK_TITLE = "spotrun: digits: controller disk full, checkpoint check skipped (the next one retries)"


def disk_full(**kw: Any) -> AlertContext:
    return storm(**({"kind": DISK, "checkpoint": WHERE, "reason": NO_SPACE} | kw))


def test_disk_full_says_where_that_the_check_retries_and_how_to_fix_it() -> None:
    msg = build_message(disk_full())
    assert msg.blocks[0]["text"]["text"] == f":floppy_disk: {DISK_TITLE}"
    assert msg.text == f"{DISK_TITLE}: {NO_SPACE}"
    f = fields(msg.blocks)
    assert (f["*Job*"], f["*Where*"], f["*Problem*"]) == ("digits", WHERE, NO_SPACE)
    assert "was skipped" in f["*Done*"] and "the next check tries again" in f["*Done*"]
    assert f["*Fix*"].startswith("free disk space on the controller's host, or point SPOTRUN_HOME at")
    # the window's restarts are another story: neither they nor the last log are shown
    assert [b["type"] for b in msg.blocks] == ["header", "section", "actions"]
    md = to_markdown(disk_full())
    assert md.startswith(f"### {DISK_TITLE}\n")
    for part in (f"- **Where:** {WHERE}", f"- **Problem:** {NO_SPACE}", "- **Fix:** free disk space"):
        assert part in md
    assert "Restarts in the last" not in md and "Last log lines" not in md


def test_disk_full_is_told_once_a_window_and_recorded(tmp_path: Path) -> None:
    """Through raise_alert and a real SQLite history: the checks after two attempts, one alert."""
    request = AlertRequest(
        kind=DISK, job="digits", window_s=HOUR, threshold=3, reason=NO_SPACE, checkpoint=WHERE
    )
    with HistoryStore.open(f"sqlite:///{tmp_path / 'history.db'}") as store:
        first = raise_alert(store, request, None, now=NOW)
        second = raise_alert(store, request, None, now=NOW + 600)
        rows = [(r.kind, r.status, r.dedup_key) for r in store.alerts(job="digits")]
    assert (first.status, second.status) == (LOGGED, SUPPRESSED)
    assert first.markdown.startswith(f"### {DISK_TITLE}\n")
    assert rows == [("disk-full", LOGGED, NEW_DISK_KEY), ("disk-full", SUPPRESSED, NEW_DISK_KEY)]

    blocker = tmp_path / "blocker"  # a file where the database's directory must go: the history is down
    blocker.write_text("")
    down = raise_alert(HistoryStore.open(f"sqlite:///{blocker / 'history.db'}"), request, None, now=NOW)
    assert down.status is LOGGED and "without the history" in down.reason
    assert "_alert history unavailable: this may repeat an earlier alert_" in down.markdown  # no counts


DISK_GAPS: list[tuple[str, dict[str, Any], str, dict[str, str]]] = [
    # (case, context changes, the fallback text, fields expected)
    ("an older event: no where", {"checkpoint": None}, f"{DISK_TITLE}: {NO_SPACE}", {"*Where*": "not known"}),
    ("no problem", {"reason": ""}, DISK_TITLE, {"*Problem*": "not known", "*Where*": WHERE}),
]


@pytest.mark.parametrize(("changes", "text", "expected"), [pytest.param(*c[1:], id=c[0]) for c in DISK_GAPS])
def test_disk_full_with_what_the_event_left_out(
    changes: dict[str, Any], text: str, expected: dict[str, str]
) -> None:
    msg = build_message(disk_full(**changes))
    assert msg.text == text
    assert expected.items() <= fields(msg.blocks).items()


AT_RISK_TITLE = (
    "spotrun: digits can no longer make its deadline 8h (2026-12-07 06:00 UTC): going on best-effort"
)
LATE = (
    "2.10 h of work left (plus 120 s to start) and 1.50 h to the deadline: late by 0.63 h even on on-demand"
)


def test_a_deadline_at_risk_says_by_how_much_that_it_goes_on_and_the_fix() -> None:
    ctx = storm(kind=AlertKind.DEADLINE_AT_RISK, checkpoint="8h (2026-12-07 06:00 UTC)", reason=LATE)
    msg = build_message(ctx)
    assert msg.blocks[0]["text"]["text"] == f":hourglass: {AT_RISK_TITLE}"
    assert msg.text == f"{AT_RISK_TITLE}: {LATE}"
    f = fields(msg.blocks)
    assert (f["*Deadline*"], f["*Problem*"]) == ("8h (2026-12-07 06:00 UTC)", LATE)
    assert "best-effort" in f["*Done*"] and "later deadlines" in f["*Fix*"]
    assert [b["type"] for b in msg.blocks] == ["header", "section", "actions"]


@pytest.mark.parametrize(
    ("seconds", "text"),
    [(3600, "1 h"), (5400, "1.5 h"), (900, "15 min"), (45, "45 s"), (86400 * 2, "2 d"), (0.5, "0.5 s")],
)
def test_human_duration(seconds: float, text: str) -> None:
    assert human_duration(seconds) == text


# -- settings -------------------------------------------------------------------------------------

WEBHOOK = "https://hooks.slack.com/services/T000/B000/s3cretPath"


class Secrets:
    """A stand-in for the Prefect Secret blocks: records what was asked."""

    def __init__(self, **values: str) -> None:
        self.values = {k.replace("_", "-"): v for k, v in values.items()}
        self.asked: list[str] = []

    def __call__(self, name: str) -> str | None:
        self.asked.append(name)
        return self.values.get(name)


def test_webhook_from_the_environment() -> None:
    secrets = Secrets()
    target = target_from_env({"SPOTRUN_SLACK_WEBHOOK_URL": f" {WEBHOOK} "}, secrets)
    assert target is not None and target.webhook_url == WEBHOOK and target.channel_kind == "slack-webhook"
    assert target.describe() == "Slack webhook https://hooks.slack.com/…"
    assert "s3cret" not in repr(target) and "s3cret" not in str(target)
    assert secrets.asked == []


def test_token_and_channel() -> None:
    env = {"SPOTRUN_SLACK_TOKEN": "xoxb-secret-token", "SPOTRUN_SLACK_CHANNEL": "#training"}
    target = target_from_env(env)
    assert target is not None
    assert (target.token, target.channel, target.api_url) == (
        "xoxb-secret-token",
        "#training",
        "https://slack.com/api/",
    )
    assert target.channel_kind == "slack-api"
    assert target.describe() == "Slack channel #training via https://slack.com"
    assert "xoxb" not in repr(target)
    local = target_from_env(env | {"SPOTRUN_SLACK_API_URL": "http://127.0.0.1:8123/api"})
    assert local is not None and local.api_url == "http://127.0.0.1:8123/api/"


@pytest.mark.parametrize(
    ("env", "missing", "block"),
    [
        ({"SPOTRUN_SLACK_TOKEN": "xoxb-secret-token"}, "SPOTRUN_SLACK_CHANNEL", "spotrun-slack-channel"),
        ({"SPOTRUN_SLACK_CHANNEL": "#training"}, "SPOTRUN_SLACK_TOKEN", "spotrun-slack-token"),
    ],
)
def test_half_a_bot_configuration_is_an_error(env: dict[str, str], missing: str, block: str) -> None:
    with pytest.raises(SlackConfigError) as e:
        target_from_env(env)
    message = str(e.value)
    assert f"{missing} is not" in message and block in message
    assert "\n" not in message and "xoxb-secret" not in message
    assert isinstance(e.value, ConfigError)


def test_nothing_configured_asks_every_secret_block() -> None:
    secrets = Secrets()
    assert target_from_env({}, secrets) is None
    assert secrets.asked == ["spotrun-slack-webhook-url", "spotrun-slack-token", "spotrun-slack-channel"]
    assert target_from_env({}) is None


def test_secret_blocks_fill_what_the_environment_leaves_unset() -> None:
    target = target_from_env({}, Secrets(spotrun_slack_webhook_url=WEBHOOK))
    assert target is not None and target.webhook_url == WEBHOOK
    mixed = target_from_env({"SPOTRUN_SLACK_CHANNEL": "#env"}, Secrets(spotrun_slack_token="xoxb-from-block"))
    assert mixed is not None and (mixed.token, mixed.channel) == ("xoxb-from-block", "#env")


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        (dict(webhook_url="hooks.slack.com/services/T/B/s3cretPath"), "not an https URL"),
        (dict(webhook_url="http://hooks.slack.com/services/T/B/s3cretPath"), "plain http only to loopback"),
        (dict(webhook_url="http://10.0.0.1/services/T/B/s3cretPath"), "not an https URL"),
        (dict(token="xoxb-1", channel="#c", api_url="http://slack.example/api/"), "must be an https URL"),
        (dict(token="xoxb-1", channel="#c", api_url="https://u:s3cret@slack.example/api"), "u:\\*\\*\\*@"),
        (dict(token="xoxb-1"), "both"),
        (dict(token="xoxb-1", channel="#c", api_url="https://slack.com/api"), "ending in '/'"),
    ],
)
def test_bad_targets_are_refused(kw: dict[str, str], match: str) -> None:
    with pytest.raises(SlackConfigError, match=match) as e:
        SlackTarget(**kw)
    assert "s3cret" not in str(e.value)


def test_the_alert_domain_does_not_import_prefect() -> None:
    code = (
        "import sys, tasks.alerts, tasks.alerts.service\n"
        "sys.exit(sorted(m for m in sys.modules if m == 'prefect' or m.startswith('prefect.'))[:3] or 0)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert (done.returncode, done.stderr) == (0, "")


@pytest.mark.parametrize(
    "kw",
    [
        dict(webhook_url="https://hooks.slack.com/services/T/B/x"),
        dict(webhook_url="http://127.0.0.1:8123/services/T/B/x"),  # loopback: tests
        dict(webhook_url="http://localhost:8123/x"),
        dict(webhook_url="http://[::1]:8123/x"),
        dict(token="xoxb-1", channel="#c", api_url="http://127.0.0.1:8123/api/"),
    ],
)
def test_https_or_loopback_targets_are_accepted(kw: dict[str, str]) -> None:
    assert SlackTarget(**kw).channel_kind in ("slack-webhook", "slack-api")


def test_credentials_are_hidden_before_any_text_is_cut() -> None:
    """A cut inside a password would leave no "@" for redaction to find: redaction comes first."""
    leak = "x" * 140 + " http://spot:" + "s" * 60 + "@db.example/h"  # CAUSE_MAX_CHARS (160) cuts its password
    ctx = storm(
        reason=leak, note=leak, restarts=[attempt_row(1, NOW - 60, cause=leak, log_tail=leak, error=leak)]
    )
    shown = [t for _, t in texts(build_message(ctx).blocks)] + [build_message(ctx).text, to_markdown(ctx)]
    assert all("sssss" not in t for t in shown), [t for t in shown if "sssss" in t]
    assert any("spot:***@" in t for t in shown)


# -- scheduled retraining: promotion, a missed deadline, a failed run ------------------------------


def _of_run(a: AlertRow, job_run_id: str) -> AlertRow:
    return replace(a, job_run_id=job_run_id)


PROMO_KEY, MISSED_KEY, FAILED_KEY = (
    "promotion:digits:2026-12-05",
    "missed-run:digits:fr-1",
    "run-failed:digits:fr-1",
)
RUN_1_GAVE_UP = _of_run(alert(GAVE_UP, GAVE_UP_1, SENT, 30), "run-1")
PER_RUN: list[tuple[str, AlertKind, str | None, str | None, bool, list[AlertRow], Action, str, str]] = [
    # (case, kind, job_run_id, subject, ended, previous alerts, action, key, the reason contains)
    ("first promotion", PROMOTION, "run-1", "2026-12-05", False, [], SEND, PROMO_KEY, "first promotion"),
    ("promotion told", PROMOTION, "run-1", "2026-12-05", False, [alert(PROMOTION, PROMO_KEY, SENT, 60)],
     SUPPRESS, PROMO_KEY, "already"),
    ("promotion failed: retried", PROMOTION, "run-1", "2026-12-05", False,
     [alert(PROMOTION, PROMO_KEY, FAILED, 60)], SEND, PROMO_KEY, "first"),
    ("another night's promotion", PROMOTION, "run-2", "2026-12-06", False,
     [alert(PROMOTION, PROMO_KEY, SENT, 60)], SEND, "promotion:digits:2026-12-06", "first"),
    ("an unkeyed job's promotion", PROMOTION, "run-1", None, False, [], SEND, "promotion:digits:run-1",
     "first"),
    ("first missed deadline", MISSED, None, "fr-1", False, [], SEND, MISSED_KEY, "first missed-deadline"),
    ("missed, told", MISSED, None, "fr-1", False, [alert(MISSED, MISSED_KEY, LOGGED, 60)], SUPPRESS,
     MISSED_KEY, "already"),
    ("missed, but it ended meanwhile", MISSED, "run-1", "fr-1", True, [], SUPPRESS, MISSED_KEY,
     "ended meanwhile"),
    ("first failed run", RUN_FAILED, "run-1", "fr-1", False, [], SEND, FAILED_KEY, "first failed-run"),
    ("failed run told", RUN_FAILED, "run-1", "fr-1", False, [alert(RUN_FAILED, FAILED_KEY, SENT, 5)],
     SUPPRESS, FAILED_KEY, "already"),
    ("it gave up: that alert told it", RUN_FAILED, "run-1", "fr-1", False, [RUN_1_GAVE_UP], SUPPRESS,
     FAILED_KEY, GAVE_UP_1),
    ("its give-up is still being retried", RUN_FAILED, "run-1", "fr-1", False,
     [_of_run(alert(GAVE_UP, GAVE_UP_1, FAILED, 30), "run-1")], SUPPRESS, FAILED_KEY, GAVE_UP_1),
    ("another run gave up", RUN_FAILED, "run-2", "fr-1", False, [RUN_1_GAVE_UP], SEND, FAILED_KEY, "first"),
    ("refused before a job run", RUN_FAILED, None, "fr-1", False, [RUN_1_GAVE_UP], SEND, FAILED_KEY, "first"),
]  # fmt: skip  # one case per line: a table


@pytest.mark.parametrize(
    ("kind", "run", "subject", "ended", "previous", "action", "key", "why"),
    [pytest.param(*case[1:], id=case[0]) for case in PER_RUN],
)
def test_decide_per_run(
    kind: AlertKind,
    run: str | None,
    subject: str | None,
    ended: bool,
    previous: list[AlertRow],
    action: Action,
    key: str,
    why: str,
) -> None:
    d = decide(kind, "digits", run, previous, window_s=HOUR, now=NOW, subject=subject, ended=ended)
    assert (d.action, d.key) == (action, key)
    assert why in d.reason


WON = PromotionFacts(
    promoted=True,
    reason="promoted: eval_loss 1.18 < 1.25 (champion v3 of 2026-12-04; min)",
    metric="eval_loss",
    mode="min",
    alias="champion",
    challenger=1.18,
    champion=1.25,
    champion_version="3",
    champion_run="2026-12-04",
    model="digits",
    version="4",
    alias_moved=True,
    run_key="2026-12-05",
    job_run_id="run-1",
)
LOST = replace(
    WON,
    promoted=False,
    reason="kept: eval_loss 1.3 > 1.25 (champion v3 of 2026-12-04; min)",
    challenger=1.3,
    alias_moved=False,
)
PROMOTIONS: list[tuple[str, PromotionFacts, str, dict[str, str]]] = [
    # (case, the decision, the header, fields expected)
    (
        "promoted",
        WON,
        ":trophy: spotrun: digits 2026-12-05: v4 promoted to champion",
        {
            "*Decision*": "promoted",
            "*New model*": "1.18 (v4)",
            "*Champion*": "1.25 (v3 of 2026-12-04)",
            "*Rule*": "eval_loss (lower is better)",
        },
    ),
    (
        "kept",
        LOST,
        ":information_source: spotrun: digits 2026-12-05: champion v3 kept",
        {"*Decision*": "kept", "*New model*": "1.3 (v4)", "*Why*": slack_escape(LOST.reason)},
    ),
    (
        "first version, no MLflow",
        replace(
            WON,
            version=None,
            champion=None,
            champion_version=None,
            champion_run=None,
            alias_moved=False,
            reason="promoted: first version",
        ),
        ":trophy: spotrun: digits 2026-12-05: the new model promoted to champion",
        {"*Champion*": "none"},
    ),
    (
        "promoted, alias not moved",
        replace(WON, alias_moved=False, better_by=0.05, mode="max"),
        ":trophy: spotrun: digits 2026-12-05: v4 promoted to champion (alias not moved: see the run's log)",
        {"*Rule*": "eval_loss (higher is better, by at least 0.05)"},
    ),
]


@pytest.mark.parametrize(("facts", "header", "expected"), [pytest.param(*c[1:], id=c[0]) for c in PROMOTIONS])
def test_promotion_message_says_moved_or_kept_with_both_values(
    facts: PromotionFacts, header: str, expected: dict[str, str]
) -> None:
    ctx = storm(kind=PROMOTION, promotion=facts)
    msg = build_message(ctx)
    assert msg.blocks[0]["text"]["text"] == header
    assert expected.items() <= fields(msg.blocks).items()
    assert msg.text == slack_escape(f"{header.split(' ', 1)[1]}: {facts.reason}")
    assert [b["type"] for b in msg.blocks] == ["header", "section", "actions"]  # no restarts, no log
    md = to_markdown(ctx)
    assert md.startswith(f"### {header.split(' ', 1)[1]}\n") and f"- **Why:** {facts.reason}" in md


SLOT = "2026-12-05 03:00:00+00:00"


def test_missed_deadline_says_which_slot_where_the_run_is_and_what_to_look_at() -> None:
    ctx = storm(kind=MISSED, checkpoint=SLOT, reason="Late", window_s=86400.0)
    msg = build_message(ctx)
    title = f"spotrun: digits: the run for {SLOT} has not finished 1 d after its slot"
    assert msg.blocks[0]["text"]["text"] == f":alarm_clock: {title}"
    assert msg.text == f"{title}: it is Late"
    f = fields(msg.blocks)
    assert (f["*Slot*"], f["*Deadline*"], f["*State*"]) == (SLOT, "1 d after the slot", "Late")
    assert "start the worker" in f["*Look at*"]
    unknown = build_message(storm(kind=MISSED, checkpoint=None, reason="", window_s=3600.0))
    assert unknown.text == "spotrun: digits: a scheduled run has not finished 1 h after its slot"
    assert fields(unknown.blocks)["*State*"] == "not known"


def test_failed_run_says_its_message() -> None:
    why = "refused: run key 'x y' is not one path component"
    msg = build_message(storm(kind=RUN_FAILED, reason=why))
    assert msg.blocks[0]["text"]["text"] == ":x: spotrun: digits: a training run ended Failed"
    assert msg.text == f"spotrun: digits: a training run ended Failed: {why}"
    assert fields(msg.blocks) == {"*Job*": "digits", "*Message*": why}


def test_a_promotion_alert_needs_its_decision() -> None:
    with pytest.raises(ConfigError, match="needs the decision"):
        AlertRequest(kind=PROMOTION, job="digits", window_s=HOUR, threshold=3)


def test_alerts_about_a_run_find_its_job_run_and_its_give_up(tmp_path: Path) -> None:
    """Through raise_alert and a real SQLite history: a run that gave up fails once (the gave-up alert);
    a later run refused at once is told, though the job's latest job run gave up; a decision once."""
    with HistoryStore.open(f"sqlite:///{tmp_path / 'history.db'}") as store:
        run = store.start_job_run("digits", "h", "fr-1", storage_uri="/s/digits", provider="local")
        gave_up = AlertRequest(kind=GAVE_UP, job="digits", window_s=HOUR, threshold=3, flow_run_id="fr-1")
        failed = replace(gave_up, kind=RUN_FAILED, reason="gave up after 3 errors")
        refused = replace(failed, flow_run_id="fr-2", reason="refused: bad key")
        promo = AlertRequest(
            kind=PROMOTION, job="digits", window_s=HOUR, threshold=3, promotion=replace(WON, job_run_id=run)
        )
        results = [
            raise_alert(store, r, None, now=NOW + i)
            for i, r in enumerate([gave_up, failed, refused, promo, promo])
        ]
        rows = [(r.kind, r.status, r.dedup_key, r.job_run_id) for r in store.alerts(job="digits")]
    assert [r.status for r in results] == [LOGGED, SUPPRESSED, LOGGED, LOGGED, SUPPRESSED]
    assert "the give-up alert gave-up:digits:" in results[1].reason
    assert rows[1:3] == [
        ("run-failed", SUPPRESSED, "run-failed:digits:fr-1", run),
        ("run-failed", LOGGED, "run-failed:digits:fr-2", None),
    ]
    assert rows[3][2:] == ("promotion:digits:2026-12-05", run)
