"""Recover a training job whose controller died: run by the crashed automation (deployments/automations.py)
when a training run goes Crashed, including a zombie the heartbeat automation marked Crashed.

Reads the crashed run, decides (tasks/ownership/recovery.py), says so with `spotrun.job.crashed`, then either
runs the same deployment again with the same parameters (the new run adopts the job and resumes from its
newest checkpoint) or, past the bound, emits `spotrun.job.gave-up` for the gave-up alert.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from prefect import flow, get_client, get_run_logger
from prefect.client.schemas.objects import FlowRun
from prefect.deployments import run_deployment

from spotrun.tasks.history.models import JobStatus
from spotrun.tasks.ownership.endings import Ending, close_job_run_of
from spotrun.tasks.ownership.recovery import (
    JOB_CRASHED,
    RESTART_TAG,
    RestartAction,
    decide_controller_restart,
    idempotency_key,
    job_tag,
    parse_flow_run_id,
    read_crashed_run,
    recovers_tag,
    restart_of,
    restart_times,
)
from spotrun.tasks.reports import reporting as report


@flow(name="recover-job", description="Rerun a training run whose controller died, within a bound.")
def recover_job(crashed_flow_run_id: str, limit: int = 3, window_s: float = 3600) -> dict[str, str]:
    logger = get_run_logger()
    crashed_id = parse_flow_run_id(crashed_flow_run_id)
    with get_client(sync_client=True) as client:
        done = restart_of(client, crashed_id)
        if done is not None:  # a second Crashed event for the same run: one restart is enough
            logger.info("flow run %s was already restarted as %s", crashed_id, done.id)
            return {"action": "already-restarted", "flow_run_id": str(done.id)}
        crashed = read_crashed_run(client, crashed_id)
        times = restart_times(client, crashed.job)
    window = timedelta(seconds=window_s)
    decision = decide_controller_restart(
        times, datetime.now(UTC), limit, window=window, cancel_requested=crashed.cancel_requested
    )
    logger.info(
        "job %s: flow run %s crashed -> %s (%s)", crashed.job, crashed_id, decision.action, decision.reason
    )
    report.emit(
        JOB_CRASHED,
        crashed.job,
        crashed_flow_run_id=str(crashed_id),
        restarts=decision.restarts,
        limit=limit,
        action=str(decision.action),
        reason=decision.reason,
    )
    if decision.action is RestartAction.GIVE_UP:
        report.emit(
            report.JOB_GAVE_UP,
            crashed.job,
            reason=decision.reason,
            checkpoint="",
            flow_run_id=str(crashed_id),
        )
        close_job_run_of(crashed.job, str(crashed_id), Ending(JobStatus.CRASHED, decision.reason))
    elif decision.action is RestartAction.LEAVE:
        close_job_run_of(crashed.job, str(crashed_id), Ending(JobStatus.CANCELLED, decision.reason))
    if decision.action is not RestartAction.RESTART:
        return {"action": str(decision.action), "reason": decision.reason}
    new = run_deployment(  # sync_compatible: a FlowRun in this sync flow
        crashed.deployment_id,
        parameters=crashed.parameters,
        timeout=0,
        tags=[RESTART_TAG, job_tag(crashed.job), recovers_tag(crashed_id)],
        idempotency_key=idempotency_key(crashed_id),
        as_subflow=False,  # its own run: cancelling or deleting this one must not touch training
    )
    assert isinstance(new, FlowRun)
    logger.info("job %s: restarted as flow run %s (%s)", crashed.job, new.id, decision.reason)
    return {"action": str(decision.action), "reason": decision.reason, "flow_run_id": str(new.id)}
