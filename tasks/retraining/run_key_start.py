"""A flow run's run key, at its start: the slot it stands for (scheduled time, the schedule's timezone,
name), read from Prefect, and the decorator that gives the training flow its key's resolved spec
(tasks/retraining/run_keys.py resolves; this is the Prefect side of it).
"""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import Callable
from datetime import UTC, datetime
from typing import ParamSpec, TypeVar, cast
from uuid import UUID

from spotrun.tasks.retraining.run_keys import Slot, resolve_job_run
from spotrun.trainer.errors import ConfigError
from spotrun.trainer.spec.job import JobSpec

P = ParamSpec("P")
R = TypeVar("R")


def flow_run_slot(of: str = "") -> Slot:
    """The running flow run's slot, or that of flow run `of` (the crashed run recover-job replaces: its
    night, not today): the scheduled time, the deployment's schedule timezone (UTC when it has none,
    several, or the API cannot say), the name."""
    from prefect import get_client
    from prefect.context import FlowRunContext
    from prefect.runtime import flow_run

    ctx = FlowRunContext.get()  # the run as the engine loaded it: no API call
    run = ctx.flow_run if ctx is not None else None
    when = (run.expected_start_time if run is not None else None) or flow_run.get_scheduled_start_time()
    deployment = str(run.deployment_id) if run is not None and run.deployment_id else None
    name = run.name if run is not None else flow_run.get_name()
    if of:
        try:
            with get_client(sync_client=True) as client:
                run = client.read_flow_run(UUID(of))
            when, name = run.expected_start_time or when, run.name
            deployment = str(run.deployment_id) if run.deployment_id else deployment
        except Exception as e:  # SQL names the key whenever its job run started; this is the fallback
            logging.getLogger(__name__).warning("slot of flow run %s not read (%s): using this run's", of, e)
    scheduled = datetime.fromtimestamp(when.timestamp(), UTC)
    return Slot(scheduled, _schedule_timezone(deployment), name or "")


def _schedule_timezone(deployment_id: str | None) -> str:
    if not deployment_id:
        return "UTC"
    from prefect import get_client

    try:
        with get_client(sync_client=True) as client:
            schedules = client.read_deployment(deployment_id).schedules
    except Exception:  # a view of the slot: the key then follows UTC, which the docs name as the default
        return "UTC"
    zones = {getattr(s.schedule, "timezone", None) or "UTC" for s in schedules}
    return zones.pop() if len(zones) == 1 else "UTC"


def _tag(flow_run_id: str | None, tag: str) -> None:
    """Add `tag` to the flow run (the slot guard and the UI tell its key by it); a view: never fatal."""
    from prefect import get_client

    if not flow_run_id:
        return
    try:
        with get_client(sync_client=True) as client:
            tags = client.read_flow_run(UUID(flow_run_id)).tags
            if tag not in tags:
                client.update_flow_run(UUID(flow_run_id), tags=[*tags, tag])
    except Exception as e:  # the guard then sees the job's name only, which makes it wait, never run twice
        logging.getLogger(__name__).warning("flow run not tagged %s: %s", tag, e)


def per_run_key(fn: Callable[P, R]) -> Callable[P, R]:
    """Decorate a flow function taking `job` and `run_key`: it runs with `job` resolved for its key
    (`resolve_job_run`), so the slot, the job run, the storage and the trainer all see one key. A key
    that cannot be resolved ends the run Failed with its one line, before anything is recorded."""
    from prefect import get_run_logger
    from prefect.runtime import flow_run
    from prefect.states import Failed

    from spotrun.tasks.history import HistoryStore
    from spotrun.tasks.ownership.job_slot import run_key_tag
    from spotrun.tasks.ownership.recovery import recovered_run
    from spotrun.tasks.settings import Settings

    signature = inspect.signature(fn)

    @functools.wraps(fn)
    def resolved(*args: P.args, **kwargs: P.kwargs) -> R:
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        job: JobSpec = bound.arguments["job"]
        settings = Settings.from_env()
        key = bound.arguments.get("run_key") or None
        try:
            if key and job.run_key is None:
                why = f"run_key {key!r} given, but job {job.name} has no run_key template"
                raise ConfigError(
                    f"{why}; add run_key to the job (e.g. {{scheduled_date}}) or leave it empty"
                )
            with HistoryStore.open(settings.database_url, journal_dir=settings.journal_dir) as store:
                recovers = recovered_run(flow_run.get_tags())
                slot = flow_run_slot(recovers)
                job, how = resolve_job_run(job, store, slot, run_key=key, recovers=recovers)
        except ConfigError as e:
            get_run_logger().error("refused: %s", e)
            return cast(R, Failed(message=f"refused: {e}"))
        if how:
            get_run_logger().info("%s", how)
        if job.run_key:
            _tag(flow_run.get_id(), run_key_tag(job.run_key))
        bound.arguments["job"] = job
        return fn(*bound.args, **bound.kwargs)

    resolved.__signature__ = signature  # type: ignore[attr-defined]
    return resolved
