"""The resilient training flow: a thin Prefect wrapper over the plain-Python control loop.

The loop (tasks/control/loop.py `run_job`) provisions, trains, releases, checks, records and decides; this
flow gives it a Prefect sink (task runs, events, artifacts, the run's log), one slot per job (a second
run of the same job waits or is refused), and hooks that close the job run's SQL row if the flow is
cancelled or crashes before the loop could. When the job is tracked in MLflow, the flow run links to
its MLflow run (an artifact). A deployment run (the UI's form, the API, an automation) whose parameters
name what this worker host does not allow (tasks/admission/trust.py) fails at once, before any of that.
"""

from __future__ import annotations

import logging
from typing import Any

from prefect import flow
from prefect.artifacts import create_link_artifact
from prefect.runtime import flow_run
from prefect.states import Completed, Failed, State

from spotrun.tasks.admission.trust import refuse_untrusted_parameters
from spotrun.tasks.control.loop import run_job
from spotrun.tasks.decisions.policy import RetryPolicy
from spotrun.tasks.ownership.endings import record_ending
from spotrun.tasks.ownership.job_slot import one_run_per_job
from spotrun.tasks.ownership.recovery import recovered_run
from spotrun.tasks.providers.local import LocalProviderConfig
from spotrun.tasks.providers.registry import ProviderConfig, build_provider
from spotrun.tasks.reports.prefect_sink import PrefectSink
from spotrun.tasks.reports.reporting import artifact_key
from spotrun.tasks.retraining.run_key_start import per_run_key
from spotrun.tasks.settings import Settings
from spotrun.trainer.spec.job import JobSpec


@flow(
    name="resilient-training",
    description="Train a job on spot workers until it is done or out of budget.",
    on_cancellation=[record_ending],  # backups: run_job records the ending first
    on_crashed=[record_ending],
)
@refuse_untrusted_parameters  # a deployment run may name only what this host's settings allow
@per_run_key  # a keyed job: this run's key, data and sources, fixed at the key's first flow run
@one_run_per_job  # a second run of a running job waits or is refused (policy.duplicate_runs)
def resilient_training(
    job: JobSpec,
    # Every kind's settings as a plain union (JSON schema anyOf), not a discriminated one (oneOf): the
    # Prefect UI offers anyOf as a choice, then that provider's form; oneOf it shows as raw JSON
    # (tasks/providers/registry.py). Either validates the same: `kind` is a Literal in each.
    provider: ProviderConfig = LocalProviderConfig(),  # noqa: B008 (the UI's default)
    policy: RetryPolicy = RetryPolicy(),  # noqa: B008
    run_key: str | None = None,
) -> State:
    """Train `job` on the provider's workers, restarting after each reclaim until done or out of budget.

    Args:
        job: what to train: the recipe, its arguments, steps, checkpoints and storage.
        provider: where workers run: local subprocesses under a simulated spot market, or EC2 spot.
        policy: how many preemptions and errors the job may spend before it gives up.
        run_key: with a keyed job (`run_key` in the spec), the key to run or continue, e.g. 2026-12-01
            for a backfill; empty: the key of this run's scheduled slot.
    """
    settings = Settings.from_env()
    run_id = str(flow_run.get_id() or "")
    workers = build_provider(provider, settings.job_dir(job.name, job.run_key) / "workers", run_id)
    recovers = recovered_run(flow_run.get_tags())  # started by recover-job: continue that job run
    scheduled = flow_run.get_scheduled_start_time()  # a deadline's duration counts from the slot
    result = run_job(
        job,
        workers,
        policy,
        PrefectSink(),
        settings=settings,
        flow_run_id=run_id,
        recovers=recovers,
        submitted=scheduled.timestamp() if scheduled is not None else None,
    )
    _link_mlflow(job, result.summary.mlflow)
    state = Completed if result.completed else Failed
    return state(message=result.message, data=result.summary.as_dict())


def _link_mlflow(job: JobSpec, mlflow: dict[str, Any] | None) -> None:
    """The MLflow run as a link artifact on the flow run (a view: never fails the run)."""
    if not mlflow or not mlflow.get("url"):
        return
    local = not str(mlflow["tracking_uri"]).startswith("http")
    note = f" (serve it first: mlflow ui --backend-store-uri {mlflow['tracking_uri']})" if local else ""
    try:
        create_link_artifact(
            mlflow["url"],
            link_text=f"MLflow run {mlflow['run_id']}",
            key=artifact_key(job.name, "mlflow"),
            description=f"metrics, preemptions and model of {job.name} in MLflow{note}",
        )
    except Exception as e:  # an artifact is a view; the run's state is the record
        logging.getLogger(__name__).warning("MLflow link artifact not created: %s", e)
