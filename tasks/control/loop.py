"""The control loop of one job: provision, train, release, check, record, decide; repeat. Plain Python.

    worker = provision(attempt)                  # the trainer on a fresh worker
    result = watch(worker); release(worker)      # always released, also on a cancel or Ctrl-C
    record = classify(result); check checkpoints # integrity only: the trainer picks the resume point
    decision = decide(records, policy)           # done | give_up | retry after a delay
                                                 # (tasks/decisions/policy.py)

`run_job` needs no Prefect server: what it reports (log lines, events, artifacts, task runs) goes to a
`Sink`. `PlainSink` logs through `logging` and keeps events in a list (tests, scripts); the flow
(flows/resilient_training.py) passes `tasks.reports.prefect_sink.PrefectSink`, which turns the same calls into
Prefect task runs, events and artifacts. Every ending reaches SQL: a cancel, Ctrl-C or an error here
records the attempt in flight and the job run's status before it propagates (JobRunLog.interrupted).
"""

from __future__ import annotations

import functools
import logging
import random
import socket
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from spotrun.tasks.control.ahead import announce, back_to_spot, hand_off, replacement_for
from spotrun.tasks.control.checkpoints import (
    CONTROLLER_DISK_FULL,
    ResumePoint,
    check_integrity,
    completed_at,
    disk_full,
    empty_cache,
)
from spotrun.tasks.control.hooks import after_attempt
from spotrun.tasks.control.market import MarketChooser
from spotrun.tasks.control.prewarm import Prewarm
from spotrun.tasks.control.rollback import roll_back
from spotrun.tasks.control.runlog import JobRunLog
from spotrun.tasks.control.sinks import PlainSink as PlainSink
from spotrun.tasks.control.sinks import Sink
from spotrun.tasks.control.warm import STANDBY_COPY, WarmStandby, from_pool, warm_of
from spotrun.tasks.control.watchdog import for_attempt, job_history
from spotrun.tasks.control.watching import WatchCalls
from spotrun.tasks.control.watching import watch as watch
from spotrun.tasks.decisions.attempts import MARKET_MOVE, AttemptRecord, Outcome
from spotrun.tasks.decisions.policy import RetryPolicy, decide
from spotrun.tasks.providers.base import (
    Market,
    Provider,
    ProvisionError,
    StopCause,
    Worker,
    stop_cause,
)
from spotrun.tasks.reports import reporting as report
from spotrun.tasks.reports.run_summary import Summary
from spotrun.tasks.settings import Settings
from spotrun.trainer.errors import ConfigError, StorageError
from spotrun.trainer.spec.job import JobSpec
from spotrun.trainer.telemetry.records import Notice

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class JobResult:
    completed: bool
    message: str  # why it gave up, or how it completed
    summary: Summary


def run_job(
    job: JobSpec,
    provider: Provider,
    policy: RetryPolicy,
    sink: Sink,
    *,
    settings: Settings,
    flow_run_id: str = "",
    recovers: str = "",
    submitted: float | None = None,
    sleep: Callable[[float], None] = time.sleep,
) -> JobResult:
    """Train `job` on `provider`'s workers until it completes or the policy gives up. `recovers`: the
    crashed flow run this one replaces (its job run is continued). `submitted`: when the run was asked
    for (a deployment run's scheduled start, epoch seconds), from which a deadline's duration counts."""
    job = settings.resolve(job)  # a relative storage: under SPOTRUN_HOME, for every worker and record
    runlog = JobRunLog.start(
        settings, job, provider.name, flow_run_id=flow_run_id, sink=sink, recovers=recovers
    )
    try:
        runlog.stop_leftover(provider)
        # A run that adopted a dead controller's attempts goes on through the loop (its last attempt may
        # have finished the job: the loop's first attempt says so, and the job's events follow).
        done = _completed_at(job, sink) if not runlog.records else None
        if done is not None:  # no worker, no attempt: its row would say "completed at step 0"
            text = f"already completed at step {done} in {job.storage}: nothing to run"
            sink.log(logging.INFO, f"job {job.name} {text}")
            return _finish(runlog, "completed", text, time.time())
        since = min(runlog.started_at, submitted or runlog.started_at)  # a deadline's clock
        return _loop(job, provider, policy, sink=sink, runlog=runlog, sleep=sleep, since=since)
    except BaseException as e:  # a cancel (TerminationSignal), Ctrl-C or a bug here: record, then re-raise
        runlog.interrupted(e)
        raise
    finally:
        runlog.store.close()


def _loop(
    job: JobSpec,
    provider: Provider,
    policy: RetryPolicy,
    *,
    sink: Sink,
    runlog: JobRunLog,
    sleep: Callable[[float], None],
    since: float,
) -> JobResult:
    rng = random.Random(job.seed)
    started = time.time()
    ahead: Prewarm | None = None  # the next attempt's worker, started at this attempt's notice
    planner = _chooser(job, runlog, sink=sink, sleep=sleep, started=since, provider=provider)
    if planner is not None and (
        refused := planner.admit(runlog.records, runlog.resume_step or 0, provider.prices)
    ):  # a deadline even on-demand cannot make, or a budget even spot cannot pay
        sink.log(logging.ERROR, f"refused: {refused}")
        return _finish(runlog, "failed", f"refused: {refused}", started)
    chooser = planner if MarketChooser.wanted(job) else None  # a budget alone: spot, as before
    try:
        while True:
            attempt = len(runlog.records) + 1
            sink.event(report.ATTEMPT_STARTED, job.name, {"attempt": attempt, "step": runlog.resume_step})
            record, ahead = _attempt(
                job, provider, sink, runlog=runlog, attempt=attempt, ready=ahead, chooser=chooser
            )
            after_attempt(job, record, sink)  # the hooks' events, and on_attempt_end (tasks/control/hooks.py)
            if record.outcome is Outcome.ROLLED_BACK:  # a loss spike: its checkpoints out, its data skipped
                _roll_back(job, record, sink)
            if record.outcome is not Outcome.COMPLETED:  # integrity only; the trainer picks the resume point
                point = sink.step("check-checkpoints", _check_checkpoints, job, runlog.cache, sink)
                if point is not None:
                    runlog.resumed(point)
                if ahead is not None:  # a standby with a newer copy of the state commits and resumes it
                    runlog.resumes_at_least(record.extra.get(STANDBY_COPY))
            runlog.record(record)
            decision = decide(runlog.records, policy, rng)
            sink.log(
                logging.INFO,
                f"attempt {attempt}: {record.outcome} ({record.cause}) "
                f"-> {decision.action} {decision.reason}",
            )
            if decision.action == "done":
                restarted = {report.RESTARTED_LABEL: str(attempt > 1).lower()}
                # the checkpoint the last attempt resumed from: the recovery note names it
                payload = {
                    "attempts": attempt,
                    "step": record.last_step,
                    "flow_run_id": runlog.flow_run_id,
                    "checkpoint": record.resumed_checkpoint or "",
                }
                sink.event(report.JOB_COMPLETED, job.name, payload, restarted)
                return _finish(runlog, "completed", "", started)
            sink.event(report.attempt_event(record), job.name, _event_payload(record, runlog))
            if decision.action == "give_up":
                sink.event(
                    report.JOB_GAVE_UP,
                    job.name,
                    {
                        "attempts": attempt,
                        "reason": decision.reason,
                        "checkpoint": runlog.resume_uri or "",
                        "flow_run_id": runlog.flow_run_id,
                    },
                )
                return _finish(runlog, "failed", decision.reason, started)
            sink.event(
                report.JOB_RESTARTED, job.name, {**_event_payload(record, runlog), "restarts": attempt}
            )
            if ahead is None:  # a prewarmed trainer is already waiting on the lease: no backoff for it
                sleep(decision.delay_s)
    finally:
        if ahead is not None:  # completed, gave up, cancelled or failed here: nobody will use it
            ahead.discard(provider)


def _chooser(
    job: JobSpec,
    runlog: JobRunLog,
    *,
    sink: Sink,
    sleep: Callable[[float], None],
    started: float,
    provider: Provider,
) -> MarketChooser | None:
    """The market policy's chooser when the job has a deadline, a max_wait_s or a budget (else None)."""
    if not MarketChooser.wanted(job) and job.budget_usd is None:
        return None
    mine = {r.worker_id for r in runlog.records}  # an adopted run's own attempts come with each decision
    history: list[AttemptRecord] = [r for r in runlog.store.attempts(job=job.name) if r.worker_id not in mine]
    return MarketChooser(job, history, started, sink, sleep=sleep, poll_s=provider.capacity_poll_s)


def _attempt(
    job: JobSpec,
    provider: Provider,
    sink: Sink,
    *,
    runlog: JobRunLog,
    attempt: int,
    ready: Prewarm | None,
    chooser: MarketChooser | None = None,
) -> tuple[AttemptRecord, Prewarm | None]:
    """One attempt, on the worker prewarmed for it or a fresh one, watched and released; its record,
    classified, and the next attempt's worker if this one's notice started it."""
    t0 = time.time()
    market_extra: dict[str, Any] = {}
    worker = ready.take() if ready is not None else None
    if worker is not None and ready is not None:
        lead = t0 - (ready.started_at or t0)
        if chooser is not None:
            market_extra = chooser.row(worker.market, ready.reason)
        market_extra.update(from_pool(ready, t0))
        sink.log(
            logging.INFO, f"attempt {attempt}: worker {worker.id} prewarmed {lead:.1f} s ago ({ready.reason})"
        )
    else:
        try:
            args = (provider, job, attempt, runlog.spec_path, runlog.released, sink, runlog.trainer_args())
            if chooser is None:
                worker = sink.step("provision", provision, *args)
            else:  # the market policy picks spot or on-demand, and waits out an outage where it pays
                done = runlog.resume_step or 0
                launch = functools.partial(_provision_on, args)
                worker, market_extra = chooser.provision(
                    lambda market: _worker_or_raise(sink.step("provision", launch, market)),
                    runlog.records,
                    done,
                )
        except ProvisionError as e:
            return runlog.provision_failed(attempt, e, t0), None
    runlog.in_flight = worker
    ahead: Prewarm | None = None
    standby: WarmStandby | None = None

    def reclaimed_args() -> list[str]:  # the replacement plans for the reclaim that is happening now
        assert worker is not None
        return runlog.trainer_args(reclaimed_after_s=time.time() - worker.started_at)

    def at_notice() -> None:
        assert ahead is not None and worker is not None
        if not ahead.started:  # the noticed trainer trains on until this replacement stands by
            announce(job, worker.id, sink)
        ahead.start(reclaimed_args)

    def at_rebalance(rec: Notice) -> None:  # elevated risk: the replacement boots, this one trains on
        assert ahead is not None and worker is not None
        if not ahead.started:
            market_extra.update(rebalance_at=rec.t, prewarmed_at="rebalance")
            sink.log(
                logging.WARNING, f"worker {worker.id}: {rec.cloud} {rec.action}: starting its replacement"
            )
            announce(job, worker.id, sink)  # read only once a notice stops it: then it hands over
        ahead.start(reclaimed_args, stand_by_s=provider.rebalance_wait_s)

    history = job_history(runlog.store, job.name, runlog.records)
    dog = for_attempt(job.watchdog, history, provider.heartbeat_timeout_s)
    finished: bool | None = None  # read before a standby takes over: it may finish the job within ms
    try:
        ahead = (
            replacement_for(provider, job, runlog, attempt=attempt + 1, now=worker, chooser=chooser)
            if provider.prewarm
            else None
        )
        back = back_to_spot(chooser, ahead, worker, runlog=runlog, sink=sink)
        warm = warm_of(provider)  # a standby armed at `started` (tasks/control/warm.py)
        standby = WarmStandby(warm, ahead, runlog.trainer_args) if warm and ahead else None
        calls = WatchCalls(
            stopping=at_notice if ahead else None,
            started=standby.started(runlog.started) if standby else runlog.started,
            step=back.on_step if back is not None else None,
            rebalance=at_rebalance if ahead and provider.rebalance_wait_s else None,
        )
        result = sink.step("train", watch, provider, worker, job, sink, calls, dog)
    except BaseException as e:
        if worker.result is None:  # interrupted before the watch began (it stops its worker itself)
            _stop_unwatched(provider, worker, e, sink)
        if ahead is not None:
            ahead.discard(provider)
        raise
    finally:
        provider.release(worker)  # plain call: also while the run is being cancelled
        runlog.released = worker.id  # gone: the next trainer may take over its storage lease
        if ahead is not None and ahead.started:
            finished = runlog.completed()
            hand_off(job, worker.id, sink)
    record = runlog.classify(worker, result, completed=finished)
    record.extra.update(market_extra)
    if standby is not None:
        record.extra.update(standby.extra(result.ended_at, provider.prices))
    if result.stopped_by is StopCause.MARKET:
        record.extra[MARKET_MOVE] = "spot"
    if result.standby_step is not None:
        record.extra[STANDBY_COPY] = result.standby_step
    if ahead is not None and ahead.started and record.outcome is Outcome.ROLLED_BACK:
        ahead.discard(provider)  # it may have resumed from a checkpoint the rollback quarantines
        ahead = None
    return record, (ahead if ahead is not None and ahead.started else None)


def _roll_back(job: JobSpec, record: AttemptRecord, sink: Sink) -> None:
    """The rollback (tasks/control/rollback.py), as a task run; a storage that cannot be reached leaves
    the checkpoints in place with an error line (the next trainer fails on that storage too)."""
    try:
        sink.step("roll-back", roll_back, job, record, sink)
    except StorageError as e:
        sink.log(logging.ERROR, f"rollback not done, checkpoints left in place: {e}")


def _stop_unwatched(provider: Provider, worker: Worker, error: BaseException, sink: Sink) -> None:
    """A Ctrl-C or cancel between provisioning and the watch (a forked trainer can be training 0.5 s
    after it starts, before a Prefect task run has begun): the trainer still gets its emergency save."""
    try:
        provider.stop(worker, stop_cause(error))
    except Exception as e:  # teardown: release() below still kills the worker
        sink.log(logging.WARNING, f"could not stop {worker.id} gracefully: {e}")


def _provision_on(args: tuple[Any, ...], market: Market) -> Worker | ProvisionError:
    """`provision` on `market`; a retryable refusal (no spot capacity) is returned, not raised: the
    market policy decides what follows, and the task run is not a failure in the UI."""
    try:
        return provision(*args, market=market)
    except ProvisionError as e:
        if not e.retryable:
            raise
        return e


def _worker_or_raise(got: Worker | ProvisionError) -> Worker:
    if isinstance(got, ProvisionError):
        raise got
    return got


def provision(
    provider: Provider,
    job: JobSpec,
    attempt: int,
    spec_path: Path,
    released: str | None,
    sink: Sink,
    more: Sequence[str] = (),
    *,
    market: Market = "spot",
) -> Worker:
    """Rent (or, locally, start) a worker running the trainer. `released`: the worker released last (or
    left by a dead controller); the new trainer may take over its storage lease at once. `more`: other
    trainer arguments (the reclaim rate an adaptive checkpoint interval plans for)."""
    extra = (["--lease-takeover", released] if released else []) + list(more)
    worker = provider.provision(job, attempt, spec_path, extra, market=market)
    sink.log(logging.INFO, f"attempt {attempt}: worker {worker.id} ({provider.name}) provisioned")
    return worker


def _event_payload(record: AttemptRecord, runlog: JobRunLog) -> dict[str, object]:
    return {
        "attempt": record.attempt,
        "cause": record.cause,
        "outcome": record.outcome.value,
        "step": record.last_step,
        # strings, never None: the alert automation renders these into deployment parameters
        "checkpoint": runlog.resume_uri or "",
        "rejected": "; ".join(f"step {s}: {why}" for s, why in record.extra.get("rejected", []))[:1000],
        "lost_steps": record.lost_steps,
        "error": record.error[:300],
        "flow_run_id": runlog.flow_run_id,
    }


Check = Callable[[JobSpec, Path, Sink], ResumePoint]  # the integrity check (a seam for tests)


def _check_checkpoints(
    job: JobSpec, cache: Path, sink: Sink, check: Check = check_integrity
) -> ResumePoint | None:
    """check_integrity, or None when it cannot be done now: the next trainer validates what it resumes
    from anyway, and the policy decides on the attempt's own ending, rather than this controller
    crashing. A storage that cannot be read is a warning (it fails the trainer too); a full disk under
    the flow cache is an alert, and the cache is emptied so that the next check can run."""
    try:
        return check(job, cache, sink)
    except StorageError as e:
        sink.log(logging.WARNING, f"checkpoints not checked ({e}); the next trainer validates its own")
        return None
    except OSError as e:
        if not disk_full(e):
            raise
        empty_cache(cache)
        problem = f"{e.strerror or e} under {cache}"
        sink.log(
            logging.ERROR,
            f"checkpoints not checked: the controller's disk is full ({problem}); "
            "emptied its flow cache, the next check tries again",
        )
        where = {"cache": str(cache), "host": socket.gethostname()}  # the alert names the disk to free
        sink.event(CONTROLLER_DISK_FULL, job.name, {"problem": problem, **where})
        return None


def _completed_at(job: JobSpec, sink: Sink) -> int | None:
    """The step the job already finished at in its storage (None: train). A storage that cannot be
    read, or holds another finished job, is left to the trainer, whose attempt records why."""
    try:
        return completed_at(job)
    except ConfigError as e:
        sink.log(logging.WARNING, f"storage check before the first attempt: {e}")
        return None


def _finish(runlog: JobRunLog, status: str, message: str, started: float) -> JobResult:
    empty_cache(runlog.cache)  # a job run that ended checks nothing more
    summary = runlog.finish(status, message, time.time() - started)
    text = message or f"completed in {len(runlog.records)} attempt(s), goodput {summary.goodput:.1%}"
    return JobResult(status == "completed", text, summary)
