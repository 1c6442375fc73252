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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, TypeVar

from tasks.control.checkpoints import (
    CONTROLLER_DISK_FULL,
    ResumePoint,
    check_integrity,
    completed_at,
    disk_full,
    empty_cache,
)
from tasks.control.hooks import after_attempt
from tasks.control.market import BackToSpot, MarketChooser
from tasks.control.prewarm import Prewarm
from tasks.control.runlog import JobRunLog
from tasks.control.warm import WarmStandby, from_pool, warm_of
from tasks.control.watchdog import ProgressWatchdog, for_attempt, job_history, watched
from tasks.decisions.attempts import MARKET_MOVE, AttemptRecord, Outcome
from tasks.decisions.outcome import resharded
from tasks.decisions.policy import RetryPolicy, decide
from tasks.providers.base import (
    Market,
    Provider,
    ProvisionError,
    StopCause,
    StopWorker,
    WatchResult,
    Worker,
    stop_cause,
)
from tasks.reports import reporting as report
from tasks.reports.run_summary import Summary
from tasks.settings import Settings
from trainer.errors import ConfigError, StorageError
from trainer.preemption.handover import write_standby
from trainer.preemption.lease import write_handoff
from trainer.spec.job import JobSpec
from trainer.telemetry.records import Durable, Notice, Record, Started, Step, Stopping

log = logging.getLogger(__name__)

_T = TypeVar("_T")
PROGRESS_EVERY_S = 2.0


class Sink(Protocol):
    """Where the control loop reports. Implementations: PlainSink (here) and PrefectSink."""

    def step(self, name: str, fn: Callable[..., _T], *args: Any) -> _T:
        """Run one step of the loop (`provision`, `train`, `check-checkpoints`): a Prefect task run."""
        ...

    def log(self, level: int, msg: str) -> None: ...

    def event(
        self, name: str, job: str, payload: dict[str, Any], labels: dict[str, str] | None = None
    ) -> None:
        """A `spotrun.*` event about the job (automations listen to them)."""
        ...

    def progress(self, job: str, step: int, total: int) -> None: ...

    def attempts(self, job: str, records: list[AttemptRecord]) -> None:
        """The attempts so far (an artifact on the flow run)."""
        ...

    def summary(self, job: str, markdown: str) -> None: ...


@dataclass
class PlainSink:
    """No Prefect: steps are plain calls, log lines go to `logging`, events are kept in `events`."""

    events: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    logger: logging.Logger = field(default_factory=lambda: logging.getLogger("spotrun.control"))

    def step(self, name: str, fn: Callable[..., _T], *args: Any) -> _T:
        return fn(*args)

    def log(self, level: int, msg: str) -> None:
        self.logger.log(level, msg)

    def event(
        self, name: str, job: str, payload: dict[str, Any], labels: dict[str, str] | None = None
    ) -> None:
        self.events.append((name, {"job": job, **payload, **(labels or {})}))

    def progress(self, job: str, step: int, total: int) -> None:
        pass

    def attempts(self, job: str, records: list[AttemptRecord]) -> None:
        pass

    def summary(self, job: str, markdown: str) -> None:
        pass


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
            if record.outcome is not Outcome.COMPLETED:  # integrity only; the trainer picks the resume point
                point = sink.step("check-checkpoints", _check_checkpoints, job, runlog.cache, sink)
                if point is not None:
                    runlog.resumed(point)
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

    def at_notice() -> None:  # the replacement plans for the reclaim that is happening now
        assert ahead is not None and worker is not None
        if not ahead.started:  # the noticed trainer trains on until this replacement stands by
            _announce(job, worker.id, sink)
        ahead.start(lambda: runlog.trainer_args(reclaimed_after_s=time.time() - worker.started_at))

    def at_rebalance(rec: Notice) -> None:  # elevated risk: the replacement boots, this one trains on
        assert ahead is not None and worker is not None
        if not ahead.started:
            market_extra.update(rebalance_at=rec.t, prewarmed_at="rebalance")
            sink.log(
                logging.WARNING, f"worker {worker.id}: {rec.cloud} {rec.action}: starting its replacement"
            )
            _announce(job, worker.id, sink)  # read only once a notice stops it: then it hands over
        ahead.start(
            lambda: runlog.trainer_args(reclaimed_after_s=time.time() - worker.started_at),
            stand_by_s=provider.rebalance_wait_s,
        )

    history = job_history(runlog.store, job.name, runlog.records)
    dog = for_attempt(job.watchdog, history, provider.heartbeat_timeout_s)
    try:
        ahead = (
            _prewarm(provider, job, runlog, attempt=attempt + 1, now=worker, chooser=chooser)
            if provider.prewarm
            else None
        )
        back = _back_to_spot(chooser, ahead, worker, runlog=runlog, sink=sink)
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
            _hand_off(job, worker.id, sink)
    record = runlog.classify(worker, result)
    record.extra.update(market_extra)
    if standby is not None:
        record.extra.update(standby.extra(result.ended_at, provider.prices))
    if result.stopped_by is StopCause.MARKET:
        record.extra[MARKET_MOVE] = "spot"
    return record, (ahead if ahead is not None and ahead.started else None)


def _back_to_spot(
    chooser: MarketChooser | None, ahead: Prewarm | None, worker: Worker, *, runlog: JobRunLog, sink: Sink
) -> BackToSpot | None:
    """The on-demand worker's watch for a move back to spot (None: not on-demand, no deadline policy, or
    a provider that cannot start a worker ahead: then only the next provisioning asks)."""
    if chooser is None or ahead is None or worker.market != "on-demand":
        return None

    def args() -> list[str]:  # the spot trainer takes over the lease as a notice's replacement does
        _announce(chooser.job, worker.id, sink)
        return runlog.trainer_args()

    return BackToSpot(chooser, ahead, runlog.records, args)


def _stop_unwatched(provider: Provider, worker: Worker, error: BaseException, sink: Sink) -> None:
    """A Ctrl-C or cancel between provisioning and the watch (a forked trainer can be training 0.5 s
    after it starts, before a Prefect task run has begun): the trainer still gets its emergency save."""
    try:
        provider.stop(worker, stop_cause(error))
    except Exception as e:  # teardown: release() below still kills the worker
        sink.log(logging.WARNING, f"could not stop {worker.id} gracefully: {e}")


def _prewarm(
    provider: Provider,
    job: JobSpec,
    runlog: JobRunLog,
    *,
    attempt: int,
    now: Worker,
    chooser: MarketChooser | None,
) -> Prewarm:
    """The next attempt's worker, to be started (in a thread) when `now` reports it is stopping; with a
    deadline policy, for a spot worker, on the market the policy picks when spot is short (an on-demand
    worker's is the move back to spot: spot only)."""

    def plain(extra: list[str]) -> Worker:
        return provider.provision(job, attempt, runlog.spec_path, extra)

    if chooser is None or now.market == "on-demand":
        return Prewarm(plain, provider.release)

    def chosen(extra: list[str]) -> Worker:
        def launch(market: Market) -> Worker:
            return provider.provision(job, attempt, runlog.spec_path, extra, market=market)

        done = (now.result.last_durable_step if now.result is not None else None) or runlog.resume_step or 0
        worker, prewarm.reason = chooser.replacement(launch, runlog.records, done)
        return worker

    prewarm = Prewarm(chosen, provider.release)
    return prewarm


def _announce(job: JobSpec, worker_id: str, sink: Sink) -> None:
    """Tell a noticed trainer that a replacement is on its way (trainer/preemption/handover.py)."""
    try:
        write_standby(job.open_storage(), worker_id, "starting")
    except (OSError, StorageError) as e:  # the trainer then stops after its announcement window
        sink.log(logging.WARNING, f"replacement for {worker_id} not announced: {e}")


def _hand_off(job: JobSpec, worker_id: str, sink: Sink) -> None:
    """Tell a prewarmed trainer waiting on the lease that its holder is gone (trainer/preemption/lease.py)."""
    try:
        write_handoff(job.open_storage(), worker_id)
    except (OSError, StorageError) as e:  # it still gets the lease when the old one's expires
        sink.log(logging.WARNING, f"lease handoff for {worker_id} not written: {e}")


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


@dataclass(frozen=True)
class WatchCalls:
    """What the controller does as a worker's records arrive (each optional)."""

    stopping: Callable[[], None] | None = None  # a stop request or a cloud notice: the worker goes away
    started: Callable[[Started], None] | None = None  # the first status record: where it trains from
    step: Callable[[int], None] | None = None  # each step, with the newest durable step (may `StopWorker`)
    rebalance: Callable[[Notice], None] | None = None  # a notice that is no stop (EC2's rebalance)


def watch(
    provider: Provider,
    worker: Worker,
    job: JobSpec,
    sink: Sink,
    calls: WatchCalls | None = None,
    dog: ProgressWatchdog | None = None,
) -> WatchResult:
    """Stream the worker's log and progress to the sink until the worker is gone, calling `calls` on
    the way; `dog` kills a worker that stops making progress (tasks/control/watchdog.py)."""
    calls = calls or WatchCalls()
    last_update = 0.0
    durable = 0
    trainer_log = False  # the provider streams the trainer's log, which says when a checkpoint is durable

    def on_status(rec: Record) -> None:
        nonlocal last_update, durable
        if isinstance(rec, Durable):
            durable = max(durable, rec.step)
        if dog is not None:
            dog.observe(rec)
        if isinstance(rec, Started):
            sink.log(logging.INFO, f"training from {rec.checkpoint or rec.resumed_from or 'scratch'}")
            for r in rec.rejected:
                sink.log(logging.WARNING, f"trainer passed over checkpoint step {r.step}: {r.reason}")
            if rec.resharded_from is not None:
                sink.log(logging.WARNING, f"resumed {resharded(rec.resharded_from, job.world_size)}")
            if rec.changes:  # allowed by resume.allow_changes: the run's numbers part from here
                changed = ", ".join(f"{c.field} {c.old} -> {c.new}" for c in rec.changes)
                sink.log(logging.WARNING, f"resumed with changed training settings ({changed}): not bitwise")
            if calls.started is not None:
                calls.started(rec)
        elif isinstance(rec, Durable) and not trainer_log:  # once: EC2 streams no log, the status says it
            sink.log(logging.INFO, f"checkpoint step {rec.step} durable")
        elif isinstance(rec, Stopping):
            sink.log(logging.WARNING, f"worker stopping on {rec.reason} at step {rec.step}")
            if calls.stopping is not None:
                calls.stopping()
        elif isinstance(rec, Notice) and rec.stop and calls.stopping is not None:
            calls.stopping()
        elif isinstance(rec, Notice) and not rec.stop and calls.rebalance is not None:
            calls.rebalance(rec)
        elif isinstance(rec, Step):
            durable = max(durable, rec.durable_step or 0)
            if calls.step is not None:
                calls.step(durable)
            if time.monotonic() - last_update > PROGRESS_EVERY_S:
                last_update = time.monotonic()
                sink.progress(job.name, rec.step, job.total_steps)

    def on_log(line: str) -> None:
        nonlocal trainer_log
        trainer_log = True
        sink.log(logging.INFO, f"[{worker.id}] {line.rstrip()}")

    try:
        return watched(provider, worker, dog, on_status=on_status, on_log=on_log)
    except StopWorker as e:  # a planned end: the provider stopped the worker as for a cancel
        sink.log(logging.INFO, f"{worker.id}: {e}")
        if worker.result is not None and worker.result.stopped_by is not None:
            return worker.result
        return provider.stop(worker, e.cause)


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
