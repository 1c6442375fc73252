"""The control loop's reports as Prefect sees them: steps as task runs, log lines in the run's log,
`spotrun.*` events, and the progress, attempts and summary artifacts on the flow run."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar
from uuid import UUID

from prefect import Task, get_run_logger, task
from prefect.cache_policies import NO_CACHE

from spotrun.tasks.decisions.attempts import AttemptRecord
from spotrun.tasks.reports import reporting as report

_T = TypeVar("_T")

# Per step: Prefect task options. The integrity check only reads storage: retried on a transient error.
STEP_OPTIONS: dict[str, dict[str, Any]] = {
    "check-checkpoints": {"retries": 2, "retry_delay_seconds": 2},
}


class PrefectSink:
    """spotrun.tasks.control.loop.Sink for a flow run (the run context must be active)."""

    def __init__(self) -> None:
        self._progress: UUID | None = None
        self._attempts: UUID | None = None  # one table, updated in place

    def step(self, name: str, fn: Callable[..., _T], *args: Any) -> _T:
        run: Task[..., _T] = task(name=name, cache_policy=NO_CACHE, **STEP_OPTIONS.get(name, {}))(fn)
        return run(*args)

    def log(self, level: int, msg: str) -> None:
        get_run_logger().log(level, "%s", msg)

    def event(
        self, name: str, job: str, payload: dict[str, Any], labels: dict[str, str] | None = None
    ) -> None:
        report.emit_labeled(name, job, labels or {}, payload)

    def progress(self, job: str, step: int, total: int) -> None:
        if self._progress is None:
            self._progress = report.new_progress(job)
        report.set_progress(self._progress, step, total)

    def attempts(self, job: str, records: list[AttemptRecord]) -> None:
        self._attempts = report.attempts_table(job, records, self._attempts)

    def summary(self, job: str, markdown: str) -> None:
        report.publish_summary(job, markdown)
