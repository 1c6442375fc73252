"""Send or suppress: the dedup policy for alerts (pure; tested with a table).

An alert is announced once per thing that happened; repeated firings of an automation, a retried
flow run, or two automations about one storm find the earlier row and are suppressed. Only alerts
that reached people (SENT, or LOGGED where no Slack is configured) suppress; a FAILED try does not,
so a retry sends again.

Dedup keys (stable: they are stored, and people search for them):

- ``restart-storm:{job}:{opened}``: one storm is one window. `opened` is the UTC time
  (``20261130T221320Z``) of the first try to announce it; later tries within `window_s` of an
  announced one reuse its key and are suppressed. A storm that goes on longer than the window is
  announced again, at most once a window, under a new key.
- ``gave-up:{job}:{job_run_id}``: once per job run (``{opened}`` when the job run is not known).
- ``recovered:{job}:{job_run_id}``: once per job run, and only when a restart-storm or gave-up alert
  reached people since that job run started: a job that restarted quietly recovers quietly.
- ``resume-mismatch:{job}:{job_run_id}:{attempt}``: once per resumed attempt whose check said
  `mismatch` (a recovery note does not follow it: the job did not fail, its results are in doubt).
- ``cannot-verify:{job}:{opened}``: like a storm, once per window per job, however many checkpoints
  the controller cannot verify and however many checks between attempts find them (a worker without
  the key leaves every checkpoint it writes unsigned: one alert says it). No recovery note follows.
- ``disk-full:{job}:{opened}``: the same, once per window per job, however many checks between
  attempts find the controller's disk full. No recovery note follows.
- ``promotion:{job}:{run_key}``: once per run key's decision (the job run id for an unkeyed job).
- ``missed-run:{job}:{flow_run_id}``: once per scheduled flow run past its deadline; not at all when the
  run ended meanwhile (the trigger and the end crossed: a failed run has its own alert).
- ``run-failed:{job}:{flow_run_id}``: once per failed training flow run, and not when a gave-up alert
  for its job run was raised (any try: one that failed is being retried): that alert told it better.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from enum import StrEnum

from spotrun.tasks.alerts.message import AlertKind, utc
from spotrun.tasks.history import AlertRow, AlertStatus

ANNOUNCED = frozenset({AlertStatus.SENT, AlertStatus.LOGGED})


class Action(StrEnum):
    SEND = "send"
    SUPPRESS = "suppress"


@dataclass(frozen=True)
class Decision:
    action: Action
    key: str
    reason: str  # one line, for the log: why it is sent or suppressed


def decide(
    kind: AlertKind,
    job: str,
    job_run_id: str | None,
    previous: Sequence[AlertRow],
    *,
    window_s: float,
    now: float,
    run_started_at: float | None = None,
    attempt: int | None = None,
    subject: str | None = None,
    ended: bool = False,
) -> Decision:
    """Send or suppress an alert of `kind` about `job`, given the alerts already recorded for it
    (`attempt`: the resumed attempt a RESUME_MISMATCH is about; `subject`: the run key or flow run an
    alert about one run is about; `ended`: a MISSED_RUN's run has ended since)."""
    mine = [a for a in previous if a.job == job]
    if kind in _PER_WINDOW:
        return _per_window(kind, job, mine, window_s=window_s, now=now)
    if kind in _PER_RUN:
        return _per_run(
            kind, job, job_run_id, mine=mine, subject=subject or job_run_id or _stamp(now), ended=ended
        )
    run = job_run_id or _stamp(now)
    key = f"{kind}:{job}:{run}"
    if kind is AlertKind.RESUME_MISMATCH:
        key += f":{attempt or 0}"
    done = [a for a in mine if a.dedup_key == key and a.status in ANNOUNCED]
    if done:
        return Decision(Action.SUPPRESS, key, f"already announced at {utc(done[-1].created_at)}")
    if kind is AlertKind.GAVE_UP:
        return Decision(Action.SEND, key, "first give-up alert for this job run")
    if kind is AlertKind.RESUME_MISMATCH:
        return Decision(Action.SEND, key, f"first mismatch alert for attempt {attempt or '?'}")
    since = run_started_at if run_started_at is not None else now - window_s
    earlier = [
        a
        for a in mine
        if a.kind in (AlertKind.RESTART_STORM, AlertKind.GAVE_UP)
        and a.status in ANNOUNCED
        and a.created_at >= since
    ]
    if not earlier:
        return Decision(Action.SUPPRESS, key, "no alert to recover from")
    return Decision(Action.SEND, key, f"recovers from {earlier[-1].dedup_key}")


# Announced at most once a window per job, under a key opened by the first try: what each is called.
_PER_WINDOW = {
    AlertKind.RESTART_STORM: "storm",
    AlertKind.CANNOT_VERIFY: "unverifiable checkpoint",
    AlertKind.DISK_FULL: "full disk",
    AlertKind.DEADLINE_AT_RISK: "deadline at risk",
}


# Announced once per run (a run key, a flow run): what the first one is called.
_PER_RUN = {
    AlertKind.PROMOTION: "promotion decision",
    AlertKind.MISSED_RUN: "missed-deadline alert",
    AlertKind.RUN_FAILED: "failed-run alert",
}


def _per_run(
    kind: AlertKind, job: str, job_run_id: str | None, *, mine: Sequence[AlertRow], subject: str, ended: bool
) -> Decision:
    key = f"{kind}:{job}:{subject}"
    done = [a for a in mine if a.dedup_key == key and a.status in ANNOUNCED]
    if done:
        return Decision(Action.SUPPRESS, key, f"already announced at {utc(done[-1].created_at)}")
    if kind is AlertKind.MISSED_RUN and ended:
        return Decision(Action.SUPPRESS, key, "the run ended meanwhile (a failed one has its own alert)")
    if kind is AlertKind.RUN_FAILED and job_run_id:
        gave_up = [a for a in mine if a.kind == AlertKind.GAVE_UP and a.job_run_id == job_run_id]
        if gave_up:
            return Decision(Action.SUPPRESS, key, f"the give-up alert {gave_up[-1].dedup_key} told it")
    return Decision(Action.SEND, key, f"first {_PER_RUN[kind]} for this run")


def _per_window(
    kind: AlertKind, job: str, mine: Sequence[AlertRow], *, window_s: float, now: float
) -> Decision:
    what = _PER_WINDOW[kind]
    recent = [a for a in mine if a.kind == kind and a.created_at >= now - window_s]
    announced = [a for a in recent if a.status in ANNOUNCED]
    if announced:
        last = announced[-1]
        reason = f"{what} already announced at {utc(last.created_at)} (within {window_s:g} s)"
        return Decision(Action.SUPPRESS, last.dedup_key, reason)
    if recent:  # earlier tries failed: the retry keeps their key
        return Decision(Action.SEND, recent[-1].dedup_key, "earlier tries were not delivered")
    return Decision(Action.SEND, f"{kind}:{job}:{_stamp(now)}", f"new {what}")


def _stamp(ts: float) -> str:
    return datetime.fromtimestamp(ts, UTC).strftime("%Y%m%dT%H%M%SZ")
