"""How an attempt ended, in one word and one line, and the accounting the attempts table stores.

Pure functions over a provider's `WatchResult` and the completion marker. The marker outranks
everything: a SIGTERM during interpreter teardown yields -15 after all work was done, and torchrun
returns 1 on SIGTERM though its workers exited 0 (measured with torch 2.13). After it, the order is:
hung (the controller's progress watchdog killed it), lost (the provider gave up on a silent worker),
the trainer's own non-retryable verdict, a reclaim the
simulator (or a cloud) announced or performed, and last whatever the exit code or signal says.
"""

from __future__ import annotations

import re
import signal
from bisect import bisect_left
from dataclasses import asdict

from spotrun.tasks.decisions import lost_steps as rule
from spotrun.tasks.decisions.attempts import AttemptRecord, Outcome
from spotrun.tasks.decisions.watchdog import describe
from spotrun.tasks.providers.base import (
    KillReason,
    NoticeKind,
    ProvisionError,
    StopCause,
    WatchResult,
    Worker,
)
from spotrun.trainer.exitcodes import ExitCode

# The trainer says retrying won't help: a bad job, a diverged loss, or another live writer on the
# storage (held, or taken over mid-run): a second writer would corrupt it, so stop and say who holds it.
FATAL_CODES = tuple(
    c.name for c in (ExitCode.CONFIG_ERROR, ExitCode.DIVERGED, ExitCode.LEASE_HELD, ExitCode.LEASE_LOST)
)
_EXCEPTION_LINE = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Interrupt|Exit)\b(:.*)?$")


def classify(result: WatchResult, completed: bool) -> tuple[Outcome, str]:
    """The outcome of an attempt and a one-line cause. `completed`: COMPLETED.json exists."""
    code, error = result.trainer_code, _first_line(result.trainer_error)
    if completed:
        ended = f" (then {_how_ended(result)})" if result.exit_code != 0 else ""
        return Outcome.COMPLETED, f"completed at step {result.last_step}{ended}"
    if result.stopped_by is StopCause.MARKET:  # a planned move: retried at once, like a reclaim
        return Outcome.PREEMPTED, _stopped_cause(result)
    if result.hung is not None:  # the watchdog's kill, or its stop on a throughput collapse
        return _watchdog_outcome(result)
    if result.stopped_by is not None:
        return Outcome.CANCELLED, _stopped_cause(result)
    if result.lost:
        return Outcome.LOST, _lost_cause(result)
    if code in FATAL_CODES:
        return Outcome.CRASHED, f"exited {code}: {error}"
    if result.notice_at is not None:
        return Outcome.PREEMPTED, _after_notice(result)
    if result.notice_kind == NoticeKind.SIM_NO_NOTICE:
        return Outcome.PREEMPTED, "reclaimed without notice (SIGKILL)"
    if result.notice_kind == NoticeKind.SPOT_INTERRUPTION:  # EC2 took the instance; the trainer saw no notice
        return Outcome.PREEMPTED, f"reclaimed by EC2 without a notice seen ({_kill_words(result)})"
    if code == ExitCode.PREEMPTED.name:
        reason = (result.stopping.reason if result.stopping is not None else "") or "a stop request"
        return Outcome.PREEMPTED, f"stopped on {reason} (no simulator notice), exited PREEMPTED"
    if code == ExitCode.STOPPED.name:  # --max-steps: a planned stop with a durable checkpoint
        return Outcome.PREEMPTED, f"stopped at --max-steps (step {result.last_step}), exited STOPPED"
    return Outcome.CRASHED, _crash_cause(result)


def resharded(saved: int, now: int) -> str:
    """How a resume across world sizes is named in the flow's log and the attempts table."""
    return f"resharded {saved}->{now} (not bitwise)"


def _crash_cause(result: WatchResult) -> str:
    code, error = result.trainer_code, _first_line(result.trainer_error)
    if code == ExitCode.CRASHED.name:
        return f"exited CRASHED: {error or 'no error text'}"
    if code == ExitCode.COMPLETED.name:
        return "exited COMPLETED but COMPLETED.json is missing"
    if result.kill_reason == KillReason.RELEASE:
        return "killed by release() while running (flow cancelled or failed)"
    if result.signal == signal.SIGKILL:
        return "killed by SIGKILL (out of memory?)"
    if result.signal is not None:
        return f"killed by {_signame(result.signal)}"
    last = last_exception(result.log_tail)
    return f"exited with code {result.exit_code} before reporting" + (f": {last}" if last else "")


def _after_notice(result: WatchResult) -> str:
    assert result.notice_at is not None
    lead = _secs(result.ended_at - result.notice_at)
    code = result.trainer_code
    if result.kill_reason == KillReason.NOTICE_WINDOW and result.killed_at is not None:
        return f"spot notice, killed after the {_secs(result.killed_at - result.notice_at)} window"
    if code == ExitCode.PREEMPTED.name:
        return f"spot notice, exited PREEMPTED after {lead}"
    if code is not None:
        error = _first_line(result.trainer_error)
        return f"spot notice, then exited {code} after {lead}" + (f": {error}" if error else "")
    if result.notice_kind == NoticeKind.SPOT_INTERRUPTION:
        return f"spot notice, then the instance was reclaimed ({_kill_words(result)}) after {lead}"
    return f"spot notice, then {_how_ended(result)} after {lead}"


STOPPED_BY = {
    StopCause.CANCEL: "flow run cancelled (or its worker shut down)",
    StopCause.INTERRUPT: "interrupted (Ctrl-C)",
    StopCause.ERROR: "the controller failed",
    StopCause.MARKET: "moved to spot by the market policy",
    StopCause.WATCHDOG: "stopped for a fresh worker",
}


def _stopped_cause(result: WatchResult) -> str:
    why = STOPPED_BY.get(result.stopped_by, str(result.stopped_by)) if result.stopped_by is not None else ""
    durable = result.last_durable_step
    if result.kill_reason == KillReason.STOP_GRACE:
        return f"{why}; the trainer did not stop within the grace period (SIGKILL), durable step {durable}"
    if result.trainer_code == ExitCode.PREEMPTED.name and durable == result.last_step:
        return f"{why}; emergency checkpoint at step {durable}"
    return f"{why}; {_how_ended(result)}, durable step {durable}"


def _lost_cause(result: WatchResult) -> str:
    silent = _secs(result.silent_s or 0.0)
    if result.started_training_at is None:
        return f"did not start training within {silent}; worker killed"
    return f"no heartbeat for {silent} (after step {result.last_step}); worker killed"


def _watchdog_outcome(result: WatchResult) -> tuple[Outcome, str]:
    """A loss spike rolls back; a throughput collapse or a timeout is a hung attempt."""
    fired = (result.hung or {}).get("fired", {})
    if fired.get("section") == "loss_spike":
        return Outcome.ROLLED_BACK, f"{describe(fired)}; worker killed, rolled back"
    if result.stopped_by is StopCause.WATCHDOG:
        return Outcome.HUNG, f"{describe(fired)}; {_stopped_cause(result)}"
    return Outcome.HUNG, f"{describe(fired)}; worker killed"


def lost_steps(result: WatchResult, next_resume_step: int | None, *, completed: bool = False) -> int:
    """Steps this attempt reached that the next one must redo (it resumes at `next_resume_step`; None:
    not known yet), by the one rule (tasks/decisions/lost_steps.py)."""
    last, start, durable = result.last_step, result.start_step, result.last_durable_step
    kept = rule.kept_step(
        last, start=start, durable=durable, next_start=next_resume_step, completed=completed
    )
    return rule.lost_steps(last, kept)


def productive_seconds(result: WatchResult) -> float:
    """Training time whose steps ended up in a durable checkpoint: from the `started` line to the moment
    the newest durable step was reached (interpolated between step samples), not to its upload."""
    durable, start = result.last_durable_step, result.started_training_at
    if durable is None or start is None or durable <= result.start_step:
        return 0.0
    samples = sorted(result.step_times)
    steps = [s for _, s in samples]
    i = bisect_left(steps, durable)
    if i == len(samples):  # no step sample that far: the durable record's own time bounds it
        reached = max((t for t, s in result.durable_times if s == durable), default=result.ended_at)
    elif i == 0 or steps[i] == durable:
        reached = samples[i][0]
    else:
        (t0, s0), (t1, s1) = samples[i - 1], samples[i]
        reached = t0 + (t1 - t0) * (durable - s0) / (s1 - s0)
    return max(0.0, reached - start)


def error_summary(result: WatchResult, outcome: Outcome, cause: str) -> str:
    """The error text stored (and compared by the retry policy): the trainer's, the log's last exception,
    or for crashes and lost workers without either, the cause."""
    text = _first_line(result.trainer_error) or last_exception(result.log_tail)
    if text:
        return text
    return cause if outcome in (Outcome.CRASHED, Outcome.LOST, Outcome.HUNG, Outcome.ROLLED_BACK) else ""


def to_record(
    worker: Worker,
    result: WatchResult,
    outcome: Outcome,
    cause: str,
    *,
    resumed_checkpoint: str | None = None,
    next_resume_step: int | None = None,
) -> AttemptRecord:
    """The attempts-table row. Without `next_resume_step`, lost steps assume a resume from the newest
    step this attempt reported durable (the run log recomputes them once the flow has an estimate)."""
    return AttemptRecord(
        attempt=worker.attempt,
        worker_id=worker.id,
        provider=worker.provider,
        started_at=worker.started_at,
        ended_at=result.ended_at,
        outcome=outcome,
        cause=cause,
        exit_code=result.exit_code,
        signal=result.signal,
        trainer_code=result.trainer_code,
        error=error_summary(result, outcome, cause),
        log_tail=result.log_tail,
        resumed_from=result.resumed_from,
        resumed_checkpoint=resumed_checkpoint,
        last_step=result.last_step,
        last_durable_step=result.last_durable_step,
        lost_steps=lost_steps(result, next_resume_step, completed=outcome is Outcome.COMPLETED),
        notice_lead_s=result.ended_at - result.notice_at if result.notice_at is not None else None,
        wall_s=max(0.0, result.ended_at - worker.started_at),
        productive_s=productive_seconds(result),
        extra={
            "notice_kind": result.notice_kind,
            "kill_reason": result.kill_reason,
            "kill_detail": result.kill_detail or None,
            "silent_s": result.silent_s,
            "started_training_at": result.started_training_at,
            "total_steps": result.started.total_steps if result.started is not None else None,
        },
    )


def add_facts(record: AttemptRecord, result: WatchResult, world_size: int) -> None:
    """What the trainer and the provider said beyond the ending, into the row's `extra`: the price, a
    resharded resume, allowed spec changes (not bitwise), the `every: auto` interval with its reason, and
    the worker's hook (`hooks`, a list: the controller's on_attempt_end joins it)."""
    if "cost" in result.facts:  # providers that rent machines price each attempt in their watch
        record.extra["cost"] = dict(result.facts["cost"])
    if "watchdog" in result.facts:  # the controller's progress watchdog: its limits, figures, firing
        record.extra["watchdog"] = dict(result.facts["watchdog"])
    if "trace" in result.facts:  # a trace replay's reclaim: the zone whose capacity dropped, and when
        record.extra["trace"] = dict(result.facts["trace"])
    started = result.started
    if started is not None and started.resharded_from is not None:
        record.extra["resharded"] = resharded(started.resharded_from, world_size)
    if started is not None and started.changes:  # resume.allow_changes: not bitwise
        record.extra["spec_changes"] = [asdict(c) for c in started.changes]
    if result.hook is not None:  # the worker's hook: its exit code, duration and output's tail
        hook = result.hook.to_json()
        record.extra["hooks"] = [{k: v for k, v in hook.items() if k not in ("kind", "t")}]
    if result.interval is not None:  # `every: auto`: the interval it settled on, and why
        iv = result.interval
        record.extra["checkpoint_interval"] = {
            "seconds": iv.seconds,
            "cost_s": iv.cost_s,
            "mtbf_s": iv.mtbf_s,
            "reason": iv.reason,
        }


def provision_failed_record(
    attempt: int, provider: str, error: ProvisionError, *, started_at: float, ended_at: float
) -> AttemptRecord:
    """The row for an attempt that never got a worker; `extra.retryable` tells the policy whether to stop."""
    return AttemptRecord(
        attempt=attempt,
        worker_id="",
        provider=provider,
        started_at=started_at,
        ended_at=ended_at,
        outcome=Outcome.PROVISION_FAILED,
        cause=f"provision failed: {_first_line(str(error))}",
        error=_first_line(str(error)),
        wall_s=max(0.0, ended_at - started_at),
        extra={"retryable": error.retryable},
    )


def last_exception(log_tail: str) -> str:
    """The last `SomeError: message` line of a log (a traceback's final line), or ""."""
    for line in reversed(log_tail.splitlines()):
        if _EXCEPTION_LINE.match(line):
            return line[:300]
    return ""


def _kill_words(result: WatchResult) -> str:
    """The cloud's own reason code when it gave one ("Server.SpotInstanceTermination"), else ours."""
    return result.kill_detail or str(result.kill_reason)


def _how_ended(result: WatchResult) -> str:
    if result.signal is not None:
        return f"killed by {_signame(result.signal)}"
    return f"exit code {result.exit_code}"


def _signame(sig: int) -> str:
    try:
        return signal.Signals(sig).name
    except ValueError:
        return f"signal {sig}"


def _secs(x: float) -> str:
    return f"{round(x, 1):g} s"


def _first_line(text: str) -> str:
    return text.strip().splitlines()[0][:300] if text.strip() else ""
