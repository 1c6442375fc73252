"""The resilient training flow: provision, train, release, validate, select, record, decide; repeat.

Reads like the runbook a person would follow at 3 a.m.: each step is a task over domain code in
tasks/, each decision a pure function tested with tables.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable

from prefect import flow, get_run_logger
from prefect.runtime import flow_run
from prefect.states import Completed, Failed, State

from tasks import reporting as report
from tasks.attempts import AttemptRecord, Outcome
from tasks.checkpoints import check_checkpoints
from tasks.endings import record_ending
from tasks.job_slot import one_run_per_job
from tasks.policy import RetryPolicy, decide
from tasks.providers import ProviderConfig
from tasks.providers.base import ProvisionError
from tasks.providers.local import LocalProviderConfig
from tasks.runlog import JobRunLog
from tasks.settings import Settings
from tasks.workers import provision_worker, train_on_worker
from trainer.spec import JobSpec


@flow(
    name="resilient-training",
    description="Train a job on spot workers until it is done or out of budget.",
    on_cancellation=[record_ending],  # backups: the `except` below records the ending first
    on_crashed=[record_ending],
)
@one_run_per_job  # a second run of a running job waits or is refused (policy.duplicate_runs)
def resilient_training(
    job: JobSpec,
    provider: ProviderConfig = LocalProviderConfig(),  # noqa: B008 (pydantic default: the UI form)
    policy: RetryPolicy = RetryPolicy(),  # noqa: B008
) -> State:
    settings = Settings.from_env()
    runlog = JobRunLog.start(
        settings, job, provider_name=provider.kind, flow_run_id=str(flow_run.get_id() or "")
    )
    try:
        return _train(job, provider, policy, runlog)
    except BaseException as e:  # a cancel (TerminationSignal), Ctrl-C or a bug here: record, then re-raise
        runlog.interrupted(e)
        raise


def _train(job: JobSpec, provider: ProviderConfig, policy: RetryPolicy, runlog: JobRunLog) -> State:
    logger = get_run_logger()
    workers = runlog.provider(provider)
    rng = random.Random(job.seed)
    started = time.time()
    progress = report.new_progress(job.name)
    while True:
        attempt = len(runlog.records) + 1
        report.emit(report.ATTEMPT_STARTED, job.name, attempt=attempt, step=runlog.resume_step)
        t0 = time.time()
        try:
            worker = provision_worker(workers, job, attempt, runlog.spec_path, runlog.released)
        except ProvisionError as e:
            record = runlog.provision_failed(attempt, e, t0)
        else:
            runlog.in_flight = worker
            try:
                result = train_on_worker(workers, worker, job, progress)
            finally:
                workers.release(worker)  # plain call: also while this flow is being cancelled
                runlog.released = worker.id  # gone: the next trainer may take over its storage lease
            record = runlog.classify(worker, result)
        if record.outcome is not Outcome.COMPLETED:
            runlog.resumed(check_checkpoints(job, runlog.cache))  # integrity only; the trainer decides
        runlog.record(record)  # clears in_flight
        decision = decide(runlog.records, policy, rng)
        logger.info("attempt %d: %s (%s) -> %s %s", attempt, record.outcome, record.cause, decision.action,
                    decision.reason)  # fmt: skip
        if decision.action == "done":
            restarted = {report.RESTARTED_LABEL: str(attempt > 1).lower()}
            payload = {"attempts": attempt, "step": record.last_step, "flow_run_id": runlog.flow_run_id}
            report.emit_labeled(report.JOB_COMPLETED, job.name, restarted, payload)
            return _finish(runlog, "completed", "", started, Completed)
        report.emit(report.attempt_event(record), job.name, **_event_payload(record, runlog))
        if decision.action == "give_up":
            report.emit(report.JOB_GAVE_UP, job.name, attempts=attempt, reason=decision.reason,
                        checkpoint=runlog.resume_uri or "", flow_run_id=runlog.flow_run_id)  # fmt: skip
            return _finish(runlog, "failed", decision.reason, started, Failed)
        report.emit(report.JOB_RESTARTED, job.name, **_event_payload(record, runlog), restarts=attempt)
        time.sleep(decision.delay_s)


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


def _finish(
    runlog: JobRunLog, status: str, message: str, started: float, state: Callable[..., State]
) -> State:
    wall = time.time() - started
    summary = runlog.finish(status, message, wall)
    text = message or f"completed in {len(runlog.records)} attempt(s), goodput {summary.goodput:.1%}"
    return state(message=text, data=summary.as_dict())
