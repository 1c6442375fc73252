"""How a job run ends when its flow does not return: a cancel, Ctrl-C, a crash of the flow's own code.

Every ending reaches SQL: the flow's `except` records the attempt in flight and the job run's final
status (tasks/control/runlog.py `JobRunLog.interrupted`), and the flow's on_cancellation / on_crashed hooks
(`record_ending`) close a job run that is still `running` when Prefect reports the state, in case the
`except` never ran (the process was torn down first). A controller that dies outright runs neither:
its run is marked Crashed by the zombie automation and the next controller adopts the job
(tasks/ownership/adoption.py).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any
from uuid import UUID

from spotrun.tasks.history.models import JobStatus

log = logging.getLogger(__name__)

CANCEL_STATES = ("CANCELLING", "CANCELLED")


@dataclass(frozen=True)
class Ending:
    status: JobStatus
    message: str


def ending_for(error: BaseException, flow_state: str | None) -> Ending:
    """The job run's final status for what interrupted the flow; `flow_state`: the flow run's state type
    as the Prefect API reports it (None: unknown), which tells a cancel from a worker shutting down."""
    if isinstance(error, KeyboardInterrupt):
        return Ending(JobStatus.CANCELLED, "interrupted (Ctrl-C); run the same command again to resume")
    if type(error).__name__ == "TerminationSignal":  # Prefect's SIGTERM bridge
        if flow_state in CANCEL_STATES:
            return Ending(JobStatus.CANCELLED, "flow run cancelled")
        return Ending(JobStatus.CRASHED, "the controller was terminated (SIGTERM) before the job ended")
    text = f"{type(error).__name__}: {error}".strip().splitlines()[0][:300]
    return Ending(JobStatus.CRASHED, f"the controller failed: {text}")


def ending_for_state(state_type: str, message: str) -> Ending:
    """The job run's final status when only the flow run's final state is known (the hooks)."""
    if state_type in CANCEL_STATES:
        return Ending(JobStatus.CANCELLED, message or "flow run cancelled")
    return Ending(JobStatus.CRASHED, message or "flow run crashed")


def flow_run_state(flow_run_id: str) -> str | None:
    """The flow run's state type from the API (e.g. "CANCELLING"), or None when it cannot be read."""
    try:
        UUID(flow_run_id)
    except ValueError:  # no flow run (a plain-Python caller) or not one of Prefect's
        return None
    from prefect import get_client

    try:
        with get_client(sync_client=True) as client:
            run = client.read_flow_run(flow_run_id)  # type: ignore[arg-type]
    except Exception as e:  # teardown path: an unreadable API must not hide the ending
        log.warning("cannot read flow run %s: %s", flow_run_id, e)
        return None
    return run.state.type.value if run.state is not None else None


def record_ending(flow: Any, flow_run: Any, state: Any) -> None:
    """on_cancellation / on_crashed hook: close this flow run's job run if it is still `running`."""
    job = (flow_run.parameters or {}).get("job") or {}
    name = job.get("name") if isinstance(job, dict) else getattr(job, "name", None)
    if name:
        close_job_run_of(name, str(flow_run.id), ending_for_state(state.type.value, state.message or ""))


def close_job_run_of(job: str, flow_run_id: str, end: Ending) -> bool:
    """Give the job run that flow run `flow_run_id` controls its final status, if it is still `running`
    (a later controller that adopted it relinked it to itself, so it is left alone). True if closed."""
    from spotrun.tasks.history import HistoryStore
    from spotrun.tasks.settings import Settings

    settings = Settings.from_env()
    store = HistoryStore.open(settings.database_url, journal_dir=settings.journal_dir)
    closed = False
    try:
        for run in store.job_runs(job, limit=10):
            if run.flow_run_id == flow_run_id and run.status is JobStatus.RUNNING:
                store.finish_job_run(run.id, end.status, end.message)
                log.warning("job run %s of %s closed as %s: %s", run.id, job, end.status, end.message)
                closed = True
    finally:
        store.close()
    return closed
