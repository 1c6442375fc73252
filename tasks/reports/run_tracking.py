"""One job run's MLflow feed and resume checks, wired for the run log (tasks/control/runlog.py).

The run log owns the job run's SQL rows; what it tells MLflow and how it judges a resume are views of
those rows, kept here so that a change to tracking never touches the bookkeeping. Nothing here may stop
training: a check that cannot be made is a warning, and MLflow's own failures stay in its thread.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any, Protocol

from spotrun.tasks.decisions.attempts import AttemptRecord, Outcome
from spotrun.tasks.providers.base import WatchResult, Worker
from spotrun.tasks.reports.reporting import RESUME_CHECKED, VERDICT_LABEL
from spotrun.tasks.tracking import ResumeCheck, ResumeChecker, Tracker, TrackingInfo, Where
from spotrun.trainer.checkpoint.format import checkpoint_uri
from spotrun.trainer.spec.job import JobSpec

INTERRUPTED_TRACKING_S = 5.0  # a cancel or Ctrl-C waits this long for MLflow; the rest waits in storage


class Sink(Protocol):
    def log(self, level: int, msg: str) -> None: ...

    def event(
        self, name: str, job: str, payload: dict[str, Any], labels: dict[str, str] | None = None
    ) -> None: ...


def stored_check(record: AttemptRecord) -> ResumeCheck | None:
    """The resume check an attempt's row carries (`extra.resume_check`), if one was made."""
    check = record.extra.get("resume_check")
    return ResumeCheck(**check) if check else None


def resume_checks(records: list[AttemptRecord]) -> list[dict[str, Any]]:
    """Every resume check the attempts carry, oldest first."""
    return [r.extra["resume_check"] for r in records if "resume_check" in r.extra]


class Store(Protocol):
    def set_mlflow_run(self, job_run_id: str, mlflow_run_id: str) -> None: ...


class RunTracking:
    """The MLflow run's feeder (when `tracking.mlflow` is on) and the resume checker of one job run."""

    def __init__(self, job: JobSpec, flow_run_id: str, sink: Sink, store: Store) -> None:
        self.job, self.flow_run_id, self.sink, self.store = job, flow_run_id, sink, store
        self.tracker: Tracker | None = None
        self.checker: ResumeChecker | None = None  # made at the first attempt's end (it opens storage)

    def start(
        self,
        home: Path,
        job_run_id: str,
        provider_name: str,
        mlflow_run_id: str | None,
        records: list[AttemptRecord],
    ) -> None:
        """Start the MLflow feed (`mlflow_run_id`: an adopted job run's) and send an adopted run's
        attempts (the run's tags say which were already sent)."""
        if not self.job.tracking.mlflow:
            return

        def attached(run_id: str) -> None:  # the tracker's thread made or re-attached the MLflow run
            try:
                self.store.set_mlflow_run(job_run_id, run_id)
            except Exception as e:  # SQL naming the MLflow run is a view: never fatal
                logging.getLogger(__name__).warning("MLflow run id not recorded in SQL: %s", e)

        where = Where.of(self.job, home, dict(os.environ))
        self.tracker = Tracker(
            self.job,
            where,
            job_run_id,
            flow_run_id=self.flow_run_id,
            provider=provider_name,
            known_run_id=mlflow_run_id,
            on_attached=attached,
        ).start()
        for r in records:
            self.tracker.attempt(r, stored_check(r))

    def check(
        self, worker: Worker, result: WatchResult, records: list[AttemptRecord], attempt: int
    ) -> ResumeCheck | None:
        """Compare what this attempt and the one it took over from computed (tasks/tracking/fidelity.py)."""
        previous = next((r for r in reversed(records) if r.outcome is not Outcome.PROVISION_FAILED), None)
        try:
            if self.checker is None:
                storage = self.job.open_storage()
                rtol = self.job.tracking.resume_rtol
                self.checker = ResumeChecker(storage, rtol, command=self.job.command is not None)
            return self.checker.check(worker, result, previous, attempt)
        except Exception as e:  # a check that cannot be made must not lose the attempt's row
            self.sink.log(logging.WARNING, f"resume check of attempt {attempt} not made: {e}")
            return None

    def started(self, attempt: int, resumed_from: int | None) -> None:
        """An attempt's trainer said where it resumed: the metrics its check reads stay until it ends."""
        if self.tracker is not None:
            self.tracker.resumed(attempt, resumed_from)

    def recorded(self, record: AttemptRecord) -> None:
        """An attempt's row is stored: its resume verdict announced, the attempt sent to MLflow."""
        check = stored_check(record)
        if check is not None:
            self._announce(check)
        if self.tracker is not None:
            self.tracker.attempt(record, check)

    def _announce(self, check: ResumeCheck) -> None:
        """The verdict as a log line and an event; a mismatch's event carries the label automations match."""
        level = logging.WARNING if check.verdict == "mismatch" else logging.INFO
        self.sink.log(level, f"resume check, {check.line()}")
        uri = checkpoint_uri(self.job.storage, check.resumed_from) if check.resumed_from is not None else ""
        where = {"checkpoint": uri, "flow_run_id": self.flow_run_id, "first_diff": check.first_diff or 0}
        payload = {**check.as_dict(), **where}
        self.sink.event(RESUME_CHECKED, self.job.name, payload, {VERDICT_LABEL: check.verdict})

    def finish(self, status: str, trained: bool) -> TrackingInfo | None:
        """The MLflow run's end (None: tracking off, or nothing trained: the run is closed unsent)."""
        if self.tracker is None:
            return None
        if not trained:  # a flow run that found its key already completed
            self.tracker.close()
            return None
        return self.tracker.finish(status)

    def interrupted(self, status: str) -> None:
        """Briefly, on a cancel or Ctrl-C: the emergency checkpoint's metrics and the run's status."""
        if self.tracker is not None:
            self.tracker.finish(status, timeout_s=INTERRUPTED_TRACKING_S)
