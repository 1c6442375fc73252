"""What an alert says: a Slack Block Kit message and the same content as Markdown (pure).

Every piece of user-provided text (job names, causes, logs) is escaped for Slack mrkdwn and bounded,
so that no text object comes near Slack's limits (3000 characters a section, 2000 a field, 150 a
header, 50 blocks) however long the log or the restart list is.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from enum import StrEnum
from typing import Any

from spotrun.tasks.alerts.runs import (
    PromotionFacts,
    failed_facts,
    failed_title,
    missed_facts,
    missed_title,
    promotion_facts,
    promotion_title,
)
from spotrun.tasks.alerts.text import clip as _clip
from spotrun.tasks.alerts.text import human_duration, utc
from spotrun.tasks.alerts.text import one_line as _one_line
from spotrun.tasks.alerts.text import times as _times
from spotrun.tasks.history import AttemptRow
from spotrun.trainer.checkpoint.signing import KEY_ENV, OLD_KEYS_ENV
from spotrun.trainer.home import HOME_SETTING
from spotrun.trainer.redact import redact


class AlertKind(StrEnum):
    RESTART_STORM = "restart-storm"  # restarts in the window reached the threshold
    GAVE_UP = "gave-up"  # the job run stopped retrying
    RECOVERED = "recovered"  # the job completed after an alert about it
    RESUME_MISMATCH = "resume-mismatch"  # a resumed attempt did not continue the lost one's training
    CANNOT_VERIFY = "cannot-verify"  # a checkpoint's signature cannot be checked with the keys held here
    DISK_FULL = "disk-full"  # the controller's disk filled up during a check: the check was skipped
    DEADLINE_AT_RISK = "deadline-at-risk"  # even on-demand from now on cannot finish by the job's deadline
    PROMOTION = "promotion"  # a keyed run's new model was promoted to the alias, or the alias kept
    MISSED_RUN = "missed-run"  # a scheduled run had not finished by its deadline after its slot
    RUN_FAILED = "run-failed"  # a training flow run ended Failed (a give-up alert covers its own)


# Kinds about something other than restarts: the restart list and the last log lines are left out.
# About one run of a keyed or scheduled job (tasks/alerts/runs.py says what they say).
_ABOUT_RUNS = frozenset({AlertKind.PROMOTION, AlertKind.MISSED_RUN, AlertKind.RUN_FAILED})
_NOT_ABOUT_RESTARTS = _ABOUT_RUNS | {
    AlertKind.RESUME_MISMATCH,
    AlertKind.CANNOT_VERIFY,
    AlertKind.DISK_FULL,
    AlertKind.DEADLINE_AT_RISK,
}


@dataclass(frozen=True, kw_only=True)
class ResumeFacts:
    """A `mismatch` resume check, as the `spotrun.attempt.resume-checked` event carries it."""

    attempt: int  # the attempt that resumed
    method: str = ""  # replay: steps computed twice; continuity: the first step after a notice
    resumed_from: int = 0  # the checkpoint's step
    steps: int = 0  # steps compared
    span: str = ""  # which: "steps 51-60"
    first_diff: int | None = None
    diff: str = ""  # the first differing step and its values before and after
    max_rel: float = 0.0
    detail: str = ""  # the check's own one line


@dataclass(frozen=True, kw_only=True)
class AlertContext:
    """Everything an alert message says; `restarts` are the window's non-completed attempts, oldest first."""

    kind: AlertKind
    job: str
    restarts: list[AttemptRow]
    window_s: float
    threshold: int
    checkpoint: str | None  # what the job resumes from (CANNOT_VERIFY: the checkpoint it is about;
    # DISK_FULL: where, the controller's flow cache and host; DEADLINE_AT_RISK: the deadline)
    flow_run_url: str | None  # the training flow run in the Prefect UI
    reason: str = ""  # why it gave up (CANNOT_VERIFY: the verifier's problem; DISK_FULL: the OS error)
    now: float  # epoch seconds
    run_attempts: int | None = None  # attempts of the job's latest job run (None: not known)
    note: str = ""  # a caveat shown with the message, e.g. "restart history unavailable"
    resume: ResumeFacts | None = None  # RESUME_MISMATCH: what the check compared and found
    promotion: PromotionFacts | None = None  # PROMOTION: the decision
    # MISSED_RUN: `checkpoint` is the slot, `reason` the run's state, `window_s` the deadline after the slot.
    # RUN_FAILED: `reason` is the run's state message.


@dataclass(frozen=True)
class SlackMessage:
    text: str  # the plain fallback for notifications
    blocks: list[dict[str, Any]]


# Slack allows 3000 characters a section, 2000 a field, 150 a header: stay well below.
SECTION_MAX_CHARS = 2800
FIELD_MAX_CHARS = 1000
HEADER_MAX_CHARS = 150
JOB_IN_TITLE_MAX_CHARS = 60
CAUSE_MAX_CHARS = 160
URI_MAX_CHARS = 500
RESTART_LINES = 10  # the newest restarts listed; older ones are counted
LOG_TAIL_LINES = 15
LOG_TAIL_MAX_CHARS = 1500
BUTTON_URL_MAX_CHARS = 3000

_EMOJI = {
    AlertKind.RESTART_STORM: ":rotating_light:",
    AlertKind.GAVE_UP: ":x:",
    AlertKind.RECOVERED: ":white_check_mark:",
    AlertKind.RESUME_MISMATCH: ":warning:",
    AlertKind.CANNOT_VERIFY: ":lock:",
    AlertKind.DISK_FULL: ":floppy_disk:",
    AlertKind.DEADLINE_AT_RISK: ":hourglass:",
    AlertKind.PROMOTION: ":trophy:",
    AlertKind.MISSED_RUN: ":alarm_clock:",
    AlertKind.RUN_FAILED: ":x:",
}
_SLACK_ESCAPES = {"&": "&amp;", "<": "&lt;", ">": "&gt;"}


def build_message(ctx: AlertContext) -> SlackMessage:
    """The alert as a Slack Block Kit message with a plain-text fallback."""
    ctx = redacted(ctx)
    kept = ctx.kind is AlertKind.PROMOTION and not (ctx.promotion and ctx.promotion.promoted)
    header = f"{':information_source:' if kept else _EMOJI[ctx.kind]} {title(ctx)}"
    blocks: list[dict[str, Any]] = [
        {"type": "header", "text": {"type": "plain_text", "text": _clip(header, HEADER_MAX_CHARS)}},
        {
            "type": "section",
            "fields": [_mrkdwn(f"*{k}*\n{v}", FIELD_MAX_CHARS) for k, v in _slack_facts(ctx)],
        },
    ]
    if ctx.restarts and ctx.kind not in _NOT_ABOUT_RESTARTS:
        blocks.append(_section(_slack_restarts(ctx)))
    log = _log_excerpt(ctx)
    if log:
        attempt, tail = log
        code = tail.replace("```", "``\u200b`")  # a fence inside the log would end the code block
        blocks.append(_section(f"*Last log lines* (attempt {attempt})\n```\n{_esc_tail(code)}\n```"))
    if ctx.note:
        blocks.append({"type": "context", "elements": [_mrkdwn(_esc_head(ctx.note, 300), 300)]})
    if ctx.flow_run_url and len(ctx.flow_run_url) <= BUTTON_URL_MAX_CHARS:
        button = {"type": "button", "text": {"type": "plain_text", "text": "Open flow run"}}
        blocks.append({"type": "actions", "elements": [button | {"url": ctx.flow_run_url}]})
    return SlackMessage(text=_esc_head(fallback_text(ctx), SECTION_MAX_CHARS), blocks=blocks)


def to_markdown(ctx: AlertContext) -> str:
    """The alert as Markdown: for the flow run's log and an artifact (when Slack is not configured)."""
    ctx = redacted(ctx)
    lines = [f"### {title(ctx)}", ""]
    lines += [f"- **{k}:** {v}" for k, v in _plain_facts(ctx)]
    if ctx.flow_run_url:
        lines.append(f"- **Flow run:** {ctx.flow_run_url}")
    if ctx.note:
        lines += ["", f"_{_md_cell(ctx.note)}_"]
    if ctx.restarts and ctx.kind not in _NOT_ABOUT_RESTARTS:
        lines += ["", f"#### Restarts in the last {human_duration(ctx.window_s)}", ""]
        lines += ["| # | ended (UTC) | outcome | cause | lost steps |", "|---|---|---|---|---|"]
        shown, hidden = _newest(ctx.restarts)
        lines += [
            f"| {r.attempt} | {utc(r.ended_at)} | {r.outcome} | {_md_cell(r.cause)} | {r.lost_steps} |"
            for r in shown
        ]
        if hidden:
            lines.append(f"| … | {hidden} earlier not shown | | | |")
    log = _log_excerpt(ctx)
    if log:
        attempt, tail = log
        fence = "`" * max(3, _longest_backtick_run(tail) + 1)
        lines += ["", f"#### Last log lines (attempt {attempt})", "", f"{fence}text", tail, fence]
    return "\n".join(lines) + "\n"


def redacted(ctx: AlertContext) -> AlertContext:
    """`ctx` with the credentials in its URLs hidden (`trainer.redact`): before any text is cut to
    length, so that a cut never leaves half a password unredacted."""
    restarts = [
        replace(r, cause=redact(r.cause), error=redact(r.error), log_tail=redact(r.log_tail))
        for r in ctx.restarts
    ]
    r = ctx.resume
    resume = r and replace(r, diff=redact(r.diff), detail=redact(r.detail))
    p = ctx.promotion
    promotion = p and replace(p, reason=redact(p.reason))
    return replace(
        ctx,
        restarts=restarts,
        reason=redact(ctx.reason),
        note=redact(ctx.note),
        checkpoint=ctx.checkpoint and redact(ctx.checkpoint),
        flow_run_url=ctx.flow_run_url and redact(ctx.flow_run_url),
        resume=resume,
        promotion=promotion,
    )


def title(ctx: AlertContext) -> str:
    """The one line that says what happened: 'spotrun: digits restarted 3 times in 1 h'."""
    if ctx.kind in _ABOUT_RUNS:
        return _run_title(ctx)
    job = _clip(ctx.job, JOB_IN_TITLE_MAX_CHARS)
    if ctx.kind is AlertKind.GAVE_UP:
        n = ctx.run_attempts or len(ctx.restarts)
        return f"spotrun: {job} gave up after {_times(n, 'attempt')}" if n else f"spotrun: {job} gave up"
    if ctx.kind is AlertKind.RECOVERED:
        n = ctx.run_attempts - 1 if ctx.run_attempts else len(ctx.restarts)
        return f"spotrun: {job} recovered: completed after {_times(n, 'restart')}"
    if ctx.kind is AlertKind.RESUME_MISMATCH:
        attempt = f" attempt {ctx.resume.attempt}" if ctx.resume is not None else ""
        return f"spotrun: {job}{attempt} resumed with different results (resume check: mismatch)"
    if ctx.kind is AlertKind.CANNOT_VERIFY:
        which = f" ({_clip(_one_line(ctx.checkpoint), 40)})" if ctx.checkpoint else ""
        return f"spotrun: {job} has a checkpoint it cannot verify{which}: kept, not quarantined"
    if ctx.kind is AlertKind.DISK_FULL:
        return f"spotrun: {job}: controller disk full, checkpoint check skipped (the next one retries)"
    if ctx.kind is AlertKind.DEADLINE_AT_RISK:
        due = f" {_clip(_one_line(ctx.checkpoint), 40)}" if ctx.checkpoint else ""
        return f"spotrun: {job} can no longer make its deadline{due}: going on best-effort"
    count = _times(len(ctx.restarts), "time") if ctx.restarts else f"at least {ctx.threshold} times"
    return f"spotrun: {job} restarted {count} in {human_duration(ctx.window_s)}"


def fallback_text(ctx: AlertContext) -> str:
    """Title, give-up reason and last failure on one line (not yet escaped)."""
    text = title(ctx)
    if ctx.kind in _ABOUT_RUNS:
        more = {
            AlertKind.PROMOTION: ctx.promotion.reason if ctx.promotion else "",
            AlertKind.MISSED_RUN: f"it is {ctx.reason}" if ctx.reason else "",
            AlertKind.RUN_FAILED: ctx.reason,
        }[ctx.kind]
        return f"{text}: {_clip(_one_line(more), CAUSE_MAX_CHARS * 2)}" if more else text
    if ctx.kind is AlertKind.RESUME_MISMATCH:
        r = ctx.resume
        what = (r.diff or r.detail) if r is not None else ""
        return f"{text}: {_clip(_one_line(what), CAUSE_MAX_CHARS * 2)}" if what else text
    if ctx.kind in (AlertKind.CANNOT_VERIFY, AlertKind.DISK_FULL, AlertKind.DEADLINE_AT_RISK):
        return f"{text}: {_clip(_one_line(ctx.reason), CAUSE_MAX_CHARS)}" if ctx.reason else text
    if ctx.kind is AlertKind.GAVE_UP and ctx.reason:
        text += f": {_clip(_one_line(ctx.reason), CAUSE_MAX_CHARS)}"
    if ctx.restarts:
        last = ctx.restarts[-1]
        text += f"; last failure: {last.outcome}: {_clip(_one_line(last.cause), CAUSE_MAX_CHARS)}"
    return text


def slack_escape(text: str) -> str:
    """Escape the three characters Slack mrkdwn treats as control characters."""
    return "".join(_SLACK_ESCAPES.get(c, c) for c in text)


# -- the pieces ----------------------------------------------------------------------------------


def _plain_facts(ctx: AlertContext) -> list[tuple[str, str]]:
    """(label, value) pairs, unescaped: the message's fields."""
    if ctx.kind is AlertKind.RESUME_MISMATCH:
        return _resume_facts(ctx)
    if ctx.kind is AlertKind.CANNOT_VERIFY:
        return _unverified_facts(ctx)
    if ctx.kind is AlertKind.DISK_FULL:
        return _disk_full_facts(ctx)
    if ctx.kind is AlertKind.DEADLINE_AT_RISK:
        return _at_risk_facts(ctx)
    if ctx.kind is AlertKind.PROMOTION:
        return promotion_facts(ctx.job, ctx.promotion or PromotionFacts())
    if ctx.kind is AlertKind.MISSED_RUN:
        return missed_facts(ctx.job, ctx.checkpoint or "", ctx.window_s, ctx.reason)
    if ctx.kind is AlertKind.RUN_FAILED:
        return failed_facts(ctx.job, ctx.reason)
    facts = [("Job", ctx.job)]
    window = human_duration(ctx.window_s)
    facts.append(("Restarts in window", f"{len(ctx.restarts)} in {window} (threshold {ctx.threshold})"))
    if ctx.kind is AlertKind.GAVE_UP and ctx.reason:
        facts.append(("Reason", _clip(_one_line(ctx.reason), CAUSE_MAX_CHARS * 2)))
    if ctx.restarts:
        last = ctx.restarts[-1]
        facts.append(("Last failure", f"{utc(last.ended_at)} ({last.outcome}, attempt {last.attempt})"))
        facts.append(("Last cause", _clip(_one_line(last.cause), CAUSE_MAX_CHARS)))
    facts.append(("Resumed from", _clip(ctx.checkpoint, URI_MAX_CHARS) if ctx.checkpoint else "not known"))
    facts.append(("Lost steps in window", str(sum(r.lost_steps for r in ctx.restarts))))
    return facts


def _run_title(ctx: AlertContext) -> str:
    if ctx.kind is AlertKind.PROMOTION:
        return promotion_title(ctx.job, ctx.promotion or PromotionFacts())
    if ctx.kind is AlertKind.MISSED_RUN:
        return missed_title(ctx.job, ctx.checkpoint or "", ctx.window_s)
    return failed_title(ctx.job)


def _resume_facts(ctx: AlertContext) -> list[tuple[str, str]]:
    """A mismatch: which attempt, from which checkpoint, which steps were compared, what differs."""
    r = ctx.resume or ResumeFacts(attempt=0)
    checkpoint = _clip(ctx.checkpoint, URI_MAX_CHARS) if ctx.checkpoint else f"step {r.resumed_from}"
    how = "computed twice" if r.method == "replay" else "the first step after the resume"
    compared = f"{r.span or _times(r.steps, 'step')} ({how})" if r.method else (r.span or "not known")
    first = r.diff or (f"step {r.first_diff}" if r.first_diff else "not known")
    return [
        ("Job", ctx.job),
        ("Attempt", str(r.attempt) if r.attempt else "not known"),
        ("Resumed from", checkpoint),
        ("Steps compared", compared),
        ("First difference", _clip(_one_line(first), CAUSE_MAX_CHARS * 2)),
        ("Largest relative difference", f"{r.max_rel:.3g}"),
        ("Check", _clip(_one_line(r.detail), CAUSE_MAX_CHARS * 2) or "mismatch"),
    ]


def _unverified_facts(ctx: AlertContext) -> list[tuple[str, str]]:
    """A signature the controller cannot check: which checkpoint, why, what was done, the fix."""
    return [
        ("Job", ctx.job),
        ("Checkpoint", _clip(ctx.checkpoint, URI_MAX_CHARS) if ctx.checkpoint else "not known"),
        ("Problem", _clip(_one_line(ctx.reason), CAUSE_MAX_CHARS * 2) or "not known"),
        (
            "Done",
            "nothing quarantined or deleted: the checkpoint is kept as it is, but not resumed from while"
            " its signature cannot be checked",
        ),
        (
            "Fix",
            f"give the workers and the controller the same {KEY_ENV}; if it was signed with a retired"
            f" key, add that key to {OLD_KEYS_ENV} (comma-separated) where the controller runs",
        ),
    ]


def _at_risk_facts(ctx: AlertContext) -> list[tuple[str, str]]:
    """A job that even on-demand cannot finish by its deadline: by how much, what goes on, the fix."""
    return [
        ("Job", ctx.job),
        ("Deadline", _clip(_one_line(ctx.checkpoint), URI_MAX_CHARS) if ctx.checkpoint else "not known"),
        ("Problem", _clip(_one_line(ctx.reason), CAUSE_MAX_CHARS * 2) or "not known"),
        (
            "Done",
            "training goes on best-effort, on on-demand from the next start: it finishes late rather"
            " than not at all",
        ),
        (
            "Fix",
            "cancel the run if a late result is worthless; else give later deadlines or fewer total_steps",
        ),
    ]


def _disk_full_facts(ctx: AlertContext) -> list[tuple[str, str]]:
    """The controller's disk filled up during a check: where, the error, what was done, the fix."""
    return [
        ("Job", ctx.job),
        ("Where", _clip(ctx.checkpoint, URI_MAX_CHARS) if ctx.checkpoint else "not known"),
        ("Problem", _clip(_one_line(ctx.reason), CAUSE_MAX_CHARS * 2) or "not known"),
        (
            "Done",
            "the check of the job's checkpoints between attempts was skipped and the controller's flow"
            " cache emptied; training goes on (the next trainer validates what it resumes from) and the"
            " next check tries again",
        ),
        (
            "Fix",
            f"free disk space on the controller's host, or point {HOME_SETTING} at a larger disk where the"
            " controller runs (the flow cache is under it)",
        ),
    ]


def _slack_facts(ctx: AlertContext) -> list[tuple[str, str]]:
    facts = [(k, _esc_head(v, FIELD_MAX_CHARS - 40)) for k, v in _plain_facts(ctx)]
    if ctx.restarts:  # the reader's local time, next to the UTC one
        ended = ctx.restarts[-1].ended_at
        facts = [
            (k, f"{v}\n<!date^{int(ended)}^{{ago}}|{utc(ended)}>" if k == "Last failure" else v)
            for k, v in facts
        ]
    return facts


def _slack_restarts(ctx: AlertContext) -> str:
    shown, hidden = _newest(ctx.restarts)
    lines = [f"*Restarts in the last {human_duration(ctx.window_s)}*"]
    if hidden:
        lines.append(f"_… {hidden} earlier not shown_")
    for r in shown:
        cause = _esc_head(_one_line(r.cause), CAUSE_MAX_CHARS)
        lines.append(f"• #{r.attempt} `{utc(r.ended_at)}` *{r.outcome}*: {cause} (lost {r.lost_steps} steps)")
    return "\n".join(lines)


def _newest(restarts: Sequence[AttemptRow]) -> tuple[list[AttemptRow], int]:
    """The newest RESTART_LINES restarts (oldest first) and how many earlier ones are left out."""
    shown = list(restarts[-RESTART_LINES:])
    return shown, len(restarts) - len(shown)


def _log_excerpt(ctx: AlertContext) -> tuple[int, str] | None:
    """(attempt, the last lines of its log, or its error) of the last failure; None when it has neither.

    Not for a recovery: the job is fine now, and the failure's log was in the alert it recovers from.
    """
    if not ctx.restarts or ctx.kind is AlertKind.RECOVERED or ctx.kind in _NOT_ABOUT_RESTARTS:
        return None
    last = ctx.restarts[-1]
    text = last.log_tail.strip() or last.error.strip()
    if not text:
        return None
    lines = text[-LOG_TAIL_MAX_CHARS * 2 :].splitlines()[-LOG_TAIL_LINES:]
    tail = "\n".join(lines)
    if len(tail) > LOG_TAIL_MAX_CHARS:  # cut at a line start: half a log line reads like garbage
        tail = tail[-LOG_TAIL_MAX_CHARS:]
        tail = tail.split("\n", 1)[1] if "\n" in tail else tail
    return last.attempt, tail


def _section(text: str) -> dict[str, Any]:
    return {"type": "section", "text": _mrkdwn(text, SECTION_MAX_CHARS)}


def _mrkdwn(text: str, limit: int) -> dict[str, str]:
    return {"type": "mrkdwn", "text": _clip(text, limit)}  # already escaped; the clip is a last guard


def _esc_head(text: str, limit: int) -> str:
    """`text` escaped, cut to at most `limit` characters (escapes counted) with '…'."""
    escaped = slack_escape(text)
    if len(escaped) <= limit:
        return escaped
    out: list[str] = []
    n = 0
    for c in text:
        e = _SLACK_ESCAPES.get(c, c)
        if n + len(e) > limit - 1:
            break
        out.append(e)
        n += len(e)
    return "".join(out) + "…"


def _esc_tail(text: str, limit: int = LOG_TAIL_MAX_CHARS) -> str:
    """The end of `text`, escaped, at most `limit` characters: the last lines say how it died."""
    out: list[str] = []
    n = 0
    for c in reversed(text):
        e = _SLACK_ESCAPES.get(c, c)
        if n + len(e) > limit:
            break
        out.append(e)
        n += len(e)
    return "".join(reversed(out))


def _md_cell(text: str) -> str:
    return _clip(_one_line(text), CAUSE_MAX_CHARS).replace("|", "\\|")


def _longest_backtick_run(text: str) -> int:
    run = best = 0
    for c in text:
        run = run + 1 if c == "`" else 0
        best = max(best, run)
    return best
