"""Raise one alert: read the history, decide, build the message, deliver, record (no Prefect here).

Every try is recorded in the `alerts` table, suppressed ones included, so the history says what
people were told and when. When the history cannot be read the alert still goes out, with what the
request says and a note: an alert that does not go out is worse than a duplicate. The record of the
try is then buffered by the store until the database answers.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime

from spotrun.tasks.alerts.decide import Action, decide
from spotrun.tasks.alerts.message import (
    AlertContext,
    AlertKind,
    PromotionFacts,
    ResumeFacts,
    SlackMessage,
    build_message,
    to_markdown,
)
from spotrun.tasks.alerts.runs import TERMINAL_STATES
from spotrun.tasks.alerts.slack import Delivery, SlackTarget, deliver
from spotrun.tasks.history import AlertRow, AlertStatus, AttemptRow, HistoryStore, JobRunRow, StoreUnavailable
from spotrun.trainer.errors import ConfigError

log = logging.getLogger(__name__)

LOG_CHANNEL = "log"
PREVIOUS_ALERTS_READ = 1000  # suppressed tries pile up in a long storm: read past them


@dataclass(frozen=True)
class AlertRequest:
    """What the automation asks for: one alert of `kind` about `job`."""

    kind: AlertKind
    job: str
    window_s: float
    threshold: int
    checkpoint: str | None = None  # what the job resumes from (from the event)
    flow_run_url: str | None = None  # the training flow run in the Prefect UI
    reason: str = ""  # why it gave up
    trigger: str = ""  # what asked, e.g. the Prefect event id
    resume: ResumeFacts | None = None  # RESUME_MISMATCH: the check (from the event)
    promotion: PromotionFacts | None = None  # PROMOTION: the decision (from the event)
    flow_run_id: str = ""  # the training flow run it is about (MISSED_RUN and RUN_FAILED: their run)

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", AlertKind(self.kind))
        if not self.job:
            raise ConfigError("an alert needs a job name")
        if self.kind is AlertKind.RESUME_MISMATCH and self.resume is None:
            raise ConfigError("a resume-mismatch alert needs the resume check it is about")
        if self.kind is AlertKind.PROMOTION and self.promotion is None:
            raise ConfigError("a promotion alert needs the decision it is about")
        if self.window_s <= 0 or self.threshold < 1:
            raise ConfigError(
                f"window_s={self.window_s} and threshold={self.threshold}: the window must be positive and"
                " the threshold at least 1"
            )


@dataclass(frozen=True)
class AlertResult:
    status: AlertStatus
    key: str  # the dedup key (see tasks.alerts.decide)
    reason: str  # why it was sent or suppressed, and any caveat, on one line
    message: SlackMessage
    markdown: str
    delivery: Delivery | None  # None: nothing was sent (suppressed, or no Slack configured)


@dataclass
class _Seen:
    """What the history says about the job (empty where it could not be read)."""

    run: JobRunRow | None = None
    run_attempts: int | None = None
    restarts: list[AttemptRow] = field(default_factory=list)
    alerts: list[AlertRow] = field(default_factory=list)
    unavailable: str = ""


def raise_alert(
    store: HistoryStore,
    request: AlertRequest,
    target: SlackTarget | None,
    *,
    now: float | None = None,
    retries: int = 2,
    retry_interval_s: float | None = None,
) -> AlertResult:
    """Send (or log, with no `target`) one alert unless it was already announced; record the try.

    Returns FAILED when Slack did not take it: the caller decides whether to raise and retry.
    """
    now = time.time() if now is None else now
    seen = _read_history(store, request, now)
    run_id = seen.run.id if seen.run is not None else None
    started = seen.run.started_at if seen.run is not None else None
    decision = decide(
        request.kind,
        request.job,
        run_id,
        seen.alerts,
        window_s=request.window_s,
        now=now,
        run_started_at=started,
        attempt=request.resume.attempt if request.resume is not None else None,
        subject=_subject(request),
        ended=request.kind is AlertKind.MISSED_RUN and request.reason in TERMINAL_STATES,
    )
    ctx = AlertContext(
        kind=request.kind,
        job=request.job,
        restarts=seen.restarts,
        window_s=request.window_s,
        threshold=request.threshold,
        checkpoint=request.checkpoint,
        flow_run_url=request.flow_run_url,
        reason=request.reason,
        now=now,
        run_attempts=seen.run_attempts,
        note=_unavailable_note(request.kind) if seen.unavailable else "",
        resume=request.resume,
        promotion=request.promotion,
    )
    message = build_message(ctx)
    reason = decision.reason + (f"; sent without the history: {seen.unavailable}" if seen.unavailable else "")

    delivery: Delivery | None = None
    channel = target.channel_kind if target is not None else LOG_CHANNEL
    if decision.action is Action.SUPPRESS:
        status = AlertStatus.SUPPRESSED
    elif target is None:
        status = AlertStatus.LOGGED
    else:
        delivery = deliver(target, message, retries=retries, retry_interval_s=retry_interval_s)
        status = AlertStatus.SENT if delivery.ok else AlertStatus.FAILED
    store.record_alert(
        dedup_key=decision.key,
        kind=request.kind,
        job=request.job,
        job_run_id=run_id,
        status=status,
        channel=channel,
        http_status=delivery.status if delivery is not None else None,
        error=delivery.error if delivery is not None else "",
        message=message.text,
        trigger=request.trigger,
        created_at=datetime.fromtimestamp(now, UTC),
    )
    return AlertResult(
        status, decision.key, reason, message=message, markdown=to_markdown(ctx), delivery=delivery
    )


def _subject(request: AlertRequest) -> str | None:
    """What an alert about one run is about: the promotion's run key, the flow run."""
    p = request.promotion
    if request.kind is AlertKind.PROMOTION and p is not None:
        return p.run_key or p.job_run_id or None
    return request.flow_run_id or None if request.kind in _ABOUT_A_FLOW_RUN else None


_ABOUT_A_FLOW_RUN = (AlertKind.MISSED_RUN, AlertKind.RUN_FAILED)
_NO_COUNTS = (
    *_ABOUT_A_FLOW_RUN,
    AlertKind.PROMOTION,
    AlertKind.RESUME_MISMATCH,
    AlertKind.CANNOT_VERIFY,
    AlertKind.DISK_FULL,
    AlertKind.DEADLINE_AT_RISK,
)


def _unavailable_note(kind: AlertKind) -> str:
    """The caveat an alert sent without the history carries."""
    if kind in _NO_COUNTS:  # no restart counts
        return "alert history unavailable: this may repeat an earlier alert"
    return "restart history unavailable: counts may be incomplete"


def _job_run(store: HistoryStore, request: AlertRequest) -> JobRunRow | None:
    """The job run the alert is about: the promotion's, the flow run's, else the job's latest. An alert
    about a flow run that never started one (refused at once, never picked up) has none: the latest
    job run is another night's."""
    p = request.promotion
    if p is not None and p.job_run_id:
        found = store.job_run(p.job_run_id)
        if found is not None:
            return found
    if request.flow_run_id:
        found = store.job_run_of_flow_run(request.flow_run_id)
        if found is not None and found.job == request.job:
            return found
        if request.kind in _ABOUT_A_FLOW_RUN:
            return None
    return store.latest_job_run(request.job)


def _read_history(store: HistoryStore, request: AlertRequest, now: float) -> _Seen:
    """The job's latest run, its restarts in the window and its recent alerts; what it can, when down."""
    seen = _Seen()
    window_start = now - request.window_s
    try:
        seen.run = _job_run(store, request)
        if seen.run is not None:
            newest = store.attempts(job_run_id=seen.run.id, limit=1)
            seen.run_attempts = newest[-1].attempt if newest else 0
        seen.restarts = store.restarts_within(request.job, datetime.fromtimestamp(window_start, UTC))
        since = min(window_start, seen.run.started_at) if seen.run is not None else window_start
        seen.alerts = store.alerts(
            job=request.job, since=datetime.fromtimestamp(since, UTC), limit=PREVIOUS_ALERTS_READ
        )
    except StoreUnavailable as e:
        seen.unavailable = str(e)
        log.warning("alert about %s goes out without the restart history: %s", request.job, e)
    return seen
