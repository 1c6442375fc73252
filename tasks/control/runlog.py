"""The bookkeeping of one job run: its SQL rows (the job run, its attempts) and the attempt records.

The flow stays a short script by delegating this here; nothing in it decides anything (decisions are in
tasks/decisions/policy.py, lost steps in tasks/decisions/lost_steps.py). What the rows are shown as lives
beside it: MLflow and the resume check (tasks/reports/run_tracking.py), the summary and timeline
(tasks/reports/run_summary.py), and the files and rules of adopting a dead controller's job run
(tasks/ownership/adoption.py).
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict
from functools import partial
from typing import Any, Protocol

import yaml

from spotrun.tasks.control.checkpoints import ResumePoint
from spotrun.tasks.control.trainer_args import skip_args, trainer_args
from spotrun.tasks.decisions.attempts import AttemptRecord
from spotrun.tasks.decisions.lost_steps import lost_steps, walk
from spotrun.tasks.decisions.outcome import add_facts, classify, provision_failed_record, to_record
from spotrun.tasks.history import HistoryStore, StoreUnavailable
from spotrun.tasks.history.models import JobRunRow
from spotrun.tasks.ownership import adoption
from spotrun.tasks.ownership.endings import ending_for, flow_run_state
from spotrun.tasks.providers.base import Provider, ProvisionError, WatchResult, Worker, stop_cause
from spotrun.tasks.reports.run_summary import Ending, RunReport, Summary
from spotrun.tasks.reports.run_tracking import RunTracking
from spotrun.tasks.retraining.completion import after_completion
from spotrun.tasks.retraining.run_keys import keyed_record, lineage_of
from spotrun.tasks.settings import Settings
from spotrun.trainer.checkpoint.completion import completed_for
from spotrun.trainer.checkpoint.format import COMPLETED, checkpoint_uri
from spotrun.trainer.errors import ConfigError, StorageError
from spotrun.trainer.spec.job import JobSpec
from spotrun.trainer.telemetry.records import Started


class ReportSink(Protocol):
    """What the run log reports through (tasks/control/loop.py's Sink is one)."""

    def log(self, level: int, msg: str) -> None: ...

    def event(
        self, name: str, job: str, payload: dict[str, Any], labels: dict[str, str] | None = None
    ) -> None: ...

    def progress(self, job: str, step: int, total: int) -> None: ...

    def attempts(self, job: str, records: list[AttemptRecord]) -> None: ...

    def summary(self, job: str, markdown: str) -> None: ...


class JobRunLog:
    """The job run's SQL rows and its attempt records, kept as the control loop goes."""

    def __init__(
        self,
        settings: Settings,
        job: JobSpec,
        store: HistoryStore,
        *,
        job_run_id: str,
        flow_run_id: str,
        sink: ReportSink,
        provider_name: str = "local",
    ) -> None:
        self.settings, self.job, self.store, self.job_run_id = settings, job, store, job_run_id
        self.sink, self.flow_run_id, self.provider_name = sink, flow_run_id, provider_name
        self.records: list[AttemptRecord] = []
        self.resume_step: int | None = None  # the flow's estimate of where the next attempt starts
        self.resume_uri: str | None = None
        self._resumes_at: int | None = None  # that estimate, made since the last record (0: scratch)
        self.dir = settings.job_dir(job.name, job.run_key)
        self.cache = self.dir / "flow-cache"
        self.spec_path = self.dir / "job.yaml"
        self._in_flight: Worker | None = None
        self.leftover: adoption.WorkerInfo | None = None  # a worker a dead controller left (adoption)
        self.released: str | None = None  # the last worker released: its lease may be taken at once
        self.adopted_from = ""  # the dead controller's flow run, when this run adopted its job run
        self.started_at = time.time()  # the job run's start (an adopted one's: its first controller's)
        self.mlflow_run_id: str | None = None  # the adopted job run's MLflow run, from SQL
        self.tracking = RunTracking(job, flow_run_id, sink, store)
        self.report = RunReport(job, job_run_id, self.dir, sink)
        self._warm_recorded = False

    @classmethod
    def start(
        cls,
        settings: Settings,
        job: JobSpec,
        provider_name: str,
        flow_run_id: str,
        sink: ReportSink,
        recovers: str = "",
    ) -> JobRunLog:
        """Open the job run: a new one, or the job's latest one whose controller died (adopted).
        `recovers`: the crashed flow run this run was started to replace (recover-job's tag), if any."""
        store = HistoryStore.open(settings.database_url, journal_dir=settings.journal_dir)
        latest = _latest_job_run(store, job, sink)
        info = adoption.read_controller(settings.job_dir(job.name, job.run_key))

        def state() -> str | None:  # asked only when this host cannot tell
            return flow_run_state(latest.flow_run_id or "") if latest is not None else None

        if latest is not None and adoption.should_adopt(
            latest, job.storage, flow_run_id, recovers=recovers, info=info, flow_state=state
        ):
            log = cls(
                settings,
                job,
                store,
                job_run_id=latest.id,
                flow_run_id=flow_run_id,
                sink=sink,
                provider_name=provider_name,
            )
            log._adopt(latest)
            return log._opened()
        run_id = store.start_job_run(
            job.name,
            job.spec_hash(),
            flow_run_id or None,
            storage_uri=job.storage,
            provider=provider_name,
            keyed=keyed_record(job),
        )
        return cls(
            settings,
            job,
            store,
            job_run_id=run_id,
            flow_run_id=flow_run_id,
            sink=sink,
            provider_name=provider_name,
        )._opened()

    def _opened(self) -> JobRunLog:
        self.dir.mkdir(parents=True, exist_ok=True)
        self.spec_path.write_text(yaml.safe_dump(self.job.model_dump(mode="json"), sort_keys=False))
        adoption.write_controller(self.dir, self.job_run_id, self.flow_run_id)
        self.tracking.start(
            self.settings.home,
            self.job_run_id,
            self.provider_name,
            mlflow_run_id=self.mlflow_run_id,
            records=self.records,
        )
        return self

    def _adopt(self, orphan: JobRunRow) -> None:
        """Continue a job run whose controller died: its attempts, budgets and numbering go on."""
        self.store.adopt_job_run(orphan.id, self.flow_run_id or None)
        self.adopted_from = orphan.flow_run_id or ""
        self.mlflow_run_id = orphan.mlflow_run_id
        self.started_at = orphan.started_at
        self.records = adoption.to_records(self.store.attempts(job_run_id=orphan.id, limit=100_000))
        left = adoption.read_worker(self.dir)
        self.leftover = left if left is not None and left.job_run_id == orphan.id else None
        self.sink.log(
            logging.WARNING,
            f"adopting job run {orphan.id} of {self.job.name} from flow run {orphan.flow_run_id}, "
            "whose controller died",
        )

    def stop_leftover(self, provider: Provider) -> None:
        """After adoption: stop the worker the dead controller left (local: its pid file; EC2: its flow
        run's instances, by tag, from any host), record that attempt as lost (controller died), and let
        the next trainer take over its storage lease at once."""
        left, self.leftover = self.leftover, None
        # by tag where the provider can (EC2, from any host: the pid file may be elsewhere); [] locally
        swept = provider.stop_leftovers(self.adopted_from) if self.adopted_from else []
        run = adoption.Leftover(self.job_run_id, self.adopted_from, self.provider_name, self.records)
        warn = partial(self.sink.log, logging.WARNING)
        worker_id, lost = adoption.close_leftover(self.job, left, swept, run=run, warn=warn)
        if worker_id is None:
            return  # it died between attempts: nothing was in flight
        self.released = worker_id
        if lost is not None:
            self.resume_step = lost.last_durable_step
            self.record(lost)
        adoption.clear_worker(self.dir)  # recorded: a later adoption must not count it again

    @property
    def in_flight(self) -> Worker | None:
        """The worker of the attempt in progress (recorded in worker.json for a controller that adopts)."""
        return self._in_flight

    @in_flight.setter
    def in_flight(self, worker: Worker | None) -> None:
        self._in_flight = worker
        if worker is not None:
            adoption.write_worker(self.dir, self.job_run_id, self.flow_run_id, worker)
        else:
            adoption.clear_worker(self.dir)

    def interrupted(self, error: BaseException) -> None:
        """The flow is ending without returning (cancel, Ctrl-C, its own error): record the attempt in
        flight (its worker was stopped gracefully by the provider) and the job run's final status."""
        cancel_signal = type(error).__name__ == "TerminationSignal"
        end = ending_for(error, flow_run_state(self.flow_run_id) if cancel_signal else None)
        worker = self._in_flight
        if worker is not None:
            result = worker.result or WatchResult(started_at=worker.started_at)
            result.stopped_by = result.stopped_by or stop_cause(error)
            result.ended_at = result.ended_at or time.time()
            try:
                self.record(self.classify(worker, result))
            except Exception as e:  # teardown: the job run status below matters more
                logging.getLogger(__name__).warning("could not record the interrupted attempt: %s", e)
        self.store.finish_job_run(self.job_run_id, end.status, end.message)
        self.tracking.interrupted(str(end.status))
        if not self.store.flush(timeout_s=5):
            logging.getLogger(__name__).warning(
                "history database unavailable: %d record(s) kept in the journal", self.store.pending
            )
        adoption.clear_controller(self.dir)

    def started(self, rec: Started) -> None:
        """A trainer said where it trains from: a warm start's source and whether it loaded, once, into
        the job run's lineage (its key's first attempt; a resumed one reports the same)."""
        if self._in_flight is not None:
            self.tracking.started(self._in_flight.attempt, rec.resumed_from)
        w = rec.warm_start
        if w is None or self._warm_recorded:
            return
        self._warm_recorded = True
        if w.loaded:
            source = f"{w.job} run {w.run_key or '-'} step {w.step}"
            self.sink.log(logging.INFO, f"warm start: {', '.join(w.parts)} from {source}")
        else:
            self.sink.log(logging.WARNING, f"warm start: none ({w.reason}); trained from scratch")
        lineage = lineage_of(self.job).as_json() | {"loaded": asdict(w)}
        try:
            self.store.annotate_job_run(self.job_run_id, "lineage", lineage)
        except Exception as e:  # lineage is a record of the run, never a reason to stop it
            self.sink.log(logging.WARNING, f"warm-start lineage not recorded in SQL: {e}")

    def trainer_args(self, reclaimed_after_s: float | None = None) -> list[str]:
        """What the next trainer is told beyond the job file (tasks/control/trainer_args.py)."""
        planned = trainer_args(
            self.job, self.store, self.provider_name, sink=self.sink, reclaimed_after_s=reclaimed_after_s
        )
        return planned + skip_args(self.records)

    def classify(
        self, worker: Worker, result: WatchResult, *, completed: bool | None = None
    ) -> AttemptRecord:
        """The attempt's record: its outcome, its facts and its resume check (and its timeline trace).
        `completed`: whether the job's completion marker was there when the worker was released (None:
        read it now)."""
        outcome, cause = classify(result, completed=self.completed() if completed is None else completed)
        record = to_record(worker, result, outcome, cause, resumed_checkpoint=self._uri(result.resumed_from))
        add_facts(record, result, self.job.world_size)
        check = self.tracking.check(worker, result, self.records, record.attempt)
        if check is not None:  # in the row: the verdict on this resume (docs/tracking.md)
            record.extra["resume_check"] = check.as_dict()
        if result.rejected:  # the trainer's own report of what it passed over: the one authority on resume
            record.extra["rejected"] = [list(r) for r in result.rejected]
            self.store.record_rejections(self.job_run_id, record.attempt, result.rejected)
        self.report.trace(record, worker, result)
        return record

    def completed(self) -> bool:
        """This job's completion marker, not another job's that the trainer refused (exit CONFIG_ERROR)."""
        try:
            return completed_for(self.job.open_storage(), self.job) is not None
        except ConfigError:
            return False
        except StorageError as e:  # the storage is down: the attempt is judged on its own ending
            self.sink.log(logging.WARNING, f"{COMPLETED} not read ({e}): the attempt counts as unfinished")
            return False

    def provision_failed(self, attempt: int, error: ProvisionError, started_at: float) -> AttemptRecord:
        """The record of an attempt that got no worker."""
        return provision_failed_record(
            attempt, self.provider_name, error, started_at=started_at, ended_at=time.time()
        )

    def resumed(self, point: ResumePoint) -> None:
        """The flow's estimate of the checkpoint the next attempt starts from (lost-steps accounting);
        what the trainer passed over reaches SQL from its `started` record (classify)."""
        self.resume_step, self.resume_uri = point.step, point.uri
        self._resumes_at = point.step or 0

    def resumes_at_least(self, step: int | None) -> None:
        """The next attempt resumes from `step` or later: a warm standby holds a copy of the state up to
        it (trainer/saving/peer.py), which it commits when it takes over."""
        if step is not None:
            self._resumes_at = max(self._resumes_at or 0, step)

    def record(self, record: AttemptRecord) -> None:
        """Store an attempt's row, its lost steps counted by the one rule (tasks/decisions/lost_steps.py) up
        to the flow's estimate of where the next attempt resumes, made since the last row (if any)."""
        _, kept = walk([*self.records, record], self._resumes_at)
        record.lost_steps = lost_steps(record.last_step, kept[-1])
        self._resumes_at = None
        self.records.append(record)
        self.store.record_attempt(self.job_run_id, record)
        if self._in_flight is not None and self._in_flight.attempt == record.attempt:
            self.in_flight = None
        self.tracking.recorded(record)
        try:
            self.sink.attempts(self.job.name, self.records)
        except Exception as e:  # an artifact is a view; the row above is the record
            logging.getLogger(__name__).warning("attempts table artifact not updated: %s", e)

    def finish(self, status: str, message: str, wall_s: float) -> Summary:
        """Store the job run's end, then its views: MLflow, the promotion decision, the summary."""
        self.store.finish_job_run(self.job_run_id, status, message)  # first: the reports below are views
        # its end as stored, not after MLflow's sync and the timeline (the goodput would not be the report's)
        end = Ending(status, message, wall_s, time.time())
        trained = bool(self.records)  # not a flow run that found its key already completed
        tracking = self.tracking.finish(status, trained)
        promotion = None
        if (
            status == "completed"
            and trained
            and (self.job.promote is not None or self.job.keep_runs is not None)
        ):
            tracked = tracking.promotion if tracking is not None else None
            promotion = after_completion(
                self.job,
                self.store,
                self.sink,
                job_run_id=self.job_run_id,
                flow_run_id=self.flow_run_id,
                tracked=tracked,
            )
        summary = self.report.summary(end, self.records, tracking, promotion)
        adoption.clear_controller(self.dir)
        if not self.store.flush(timeout_s=10):
            self.sink.log(
                logging.WARNING,
                f"history database still unavailable: {self.store.pending} record(s) wait in the journal "
                "and are written when it answers",
            )
        return summary

    def _uri(self, step: int | None) -> str | None:
        return None if step is None else checkpoint_uri(self.job.storage, step)


def _latest_job_run(store: HistoryStore, job: JobSpec, sink: ReportSink) -> JobRunRow | None:
    """The job's latest job run, to adopt if its controller died; None when the database is down."""
    try:
        return store.latest_job_run(job.name, job.run_key)
    except StoreUnavailable as e:  # a database that is down never stops training: no adoption then
        sink.log(logging.WARNING, f"cannot look for a job run to adopt: {e}")
        return None
