"""The bookkeeping of one job run: its attempts, SQL history, resume point and final report.

The flow stays a short script by delegating all of this here; nothing in it decides anything
(decisions are in tasks/policy.py).
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

import yaml

from tasks import adoption, goodput
from tasks import reporting as report
from tasks.attempts import AttemptRecord, Outcome
from tasks.checkpoints import ResumePoint
from tasks.completion import after_completion
from tasks.endings import ending_for, flow_run_state
from tasks.goodput import RunInfo
from tasks.history import HistoryStore, StoreUnavailable
from tasks.history.models import JobRunRow
from tasks.mtbf import estimate_mtbf
from tasks.outcome import classify, provision_failed_record, resharded, to_record
from tasks.providers.aws import AwsProvider
from tasks.providers.base import Provider, ProvisionError, WatchResult, Worker, stop_cause
from tasks.reporting import RESUME_CHECKED, VERDICT_LABEL
from tasks.run_keys import keyed_record, lineage_of
from tasks.settings import Settings
from tasks.timeline import AttemptTrace, plot_timeline
from tasks.tracking import ResumeCheck, ResumeChecker, Tracker, Where, worst_verdict
from trainer.catalog import read_latest
from trainer.ckpt_format import COMPLETED, checkpoint_uri
from trainer.errors import ConfigError, StorageError
from trainer.heartbeat import read_heartbeat
from trainer.records import Started
from trainer.resume import completed_for
from trainer.spec import JobSpec
from trainer.storage import open_storage, put_bytes
from trainer.storage.registry import is_local

INTERRUPTED_TRACKING_S = 5.0  # a cancel or Ctrl-C waits this long for MLflow; the rest waits in storage


def total_cost(records: list[AttemptRecord]) -> tuple[float | None, float | None]:
    """(what the attempts cost, what the same hours cost on demand); None where any price is unknown."""
    costs = [r.extra["cost"] for r in records if "cost" in r.extra]
    if not costs:
        return None, None

    def total(key: str) -> float | None:
        values = [c.get(key) for c in costs]
        return None if any(v is None for v in values) else float(sum(values))

    return total("usd"), total("on_demand_usd")


@dataclass
class Summary:
    status: str
    message: str
    attempts: int
    final_step: int
    goodput: float  # effective training time / wall time, as `spotrun report` (tasks/goodput.py); 0: none
    wall_s: float
    timeline: str
    cost_usd: float | None = None  # summed over attempts, where the provider prices them
    on_demand_usd: float | None = None  # the same instance hours at the on-demand price
    checkpoint_interval: dict[str, Any] | None = None  # `every: auto`: the last choice and why
    resume_checks: list[dict[str, Any]] = field(default_factory=list)  # one per resumed attempt checked
    resume_fidelity: str | None = None  # the worst verdict: exact, close or mismatch (None: none checked)
    mlflow: dict[str, Any] | None = None  # the MLflow run (tasks.tracking.TrackingInfo); None: tracking off
    run_key: str | None = None  # a keyed job's run key
    promotion: dict[str, Any] | None = None  # the promotion gate's decision (tasks/promotion.py)

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def tracking_markdown(s: Summary) -> str:
    """The summary artifact's lines on resume fidelity and the MLflow run (empty when there is neither)."""
    lines = []
    if s.resume_checks:
        lines.append(f"**Resume fidelity**: {s.resume_fidelity}")
        lines += [
            f"- attempt {c['attempt']} ({c['method']}): {c['verdict']}, {c['detail']}"
            for c in s.resume_checks
        ]
    if s.run_key:
        lines.append(f"**Run key**: `{s.run_key}`")
    if s.promotion is not None:
        verdict = "moved" if s.promotion.get("promoted") else "kept"
        lines.append(f"**Promotion** ({s.promotion.get('alias')} {verdict}): {s.promotion.get('reason')}")
    m = s.mlflow
    if m is not None and m.get("run_id"):
        model = f", model `{m['model']}`" if m.get("model") else ""
        where = f"in `{m['experiment']}` at {m['tracking_uri']}"
        lines.append(f"**MLflow**: run [{m['run_id']}]({m['url']}) {where}{model}")
    return "\n\n" + "\n".join(lines) if lines else ""


class ReportSink(Protocol):
    """What the run log reports through (tasks/control.py's Sink is one)."""

    def log(self, level: int, msg: str) -> None: ...

    def event(
        self, name: str, job: str, payload: dict[str, Any], labels: dict[str, str] | None = None
    ) -> None: ...

    def progress(self, job: str, step: int, total: int) -> None: ...

    def attempts(self, job: str, records: list[AttemptRecord]) -> None: ...

    def summary(self, job: str, markdown: str) -> None: ...


class JobRunLog:
    def __init__(
        self,
        settings: Settings,
        job: JobSpec,
        store: HistoryStore,
        job_run_id: str,
        flow_run_id: str,
        sink: ReportSink,
    ) -> None:
        self.settings, self.job, self.store, self.job_run_id = settings, job, store, job_run_id
        self.sink = sink
        self.flow_run_id = flow_run_id
        self.provider_name = "local"
        self.records: list[AttemptRecord] = []
        self.traces: list[AttemptTrace] = []
        self.resume_step: int | None = None
        self.resume_uri: str | None = None
        self.dir = settings.job_dir(job.name, job.run_key)
        self.cache = self.dir / "flow-cache"
        self.spec_path = self.dir / "job.yaml"
        self._in_flight: Worker | None = None
        self.leftover: adoption.WorkerInfo | None = None  # a worker a dead controller left (adoption)
        self.released: str | None = None  # the last worker released: its lease may be taken at once
        self.adopted_from = ""  # the dead controller's flow run, when this run adopted its job run
        self.tracker: Tracker | None = None  # the MLflow run's feeder (tracking.mlflow)
        self.mlflow_run_id: str | None = None  # the adopted job run's MLflow run, from SQL
        self.checker: ResumeChecker | None = None  # made at the first attempt's end (it opens storage)
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
        job_dir = settings.job_dir(job.name, job.run_key)
        try:
            latest = store.latest_job_run(job.name, job.run_key)
        except StoreUnavailable as e:  # a database that is down never stops training: no adoption then
            sink.log(logging.WARNING, f"cannot look for a job run to adopt: {e}")
            latest = None
        info = adoption.read_controller(job_dir)

        def state() -> str | None:  # asked only when this host cannot tell
            return flow_run_state(latest.flow_run_id or "") if latest is not None else None

        if adoption.should_adopt(latest, job.storage, flow_run_id, recovers, info, state):
            assert latest is not None
            log = cls(settings, job, store, latest.id, flow_run_id, sink)
            log.provider_name = provider_name
            log._adopt(latest)
            return log._opened()
        run_id = store.start_job_run(
            job.name, job.spec_hash(), flow_run_id or None, job.storage, provider_name, keyed_record(job)
        )
        log = cls(settings, job, store, run_id, flow_run_id, sink)
        log.provider_name = provider_name
        return log._opened()

    def _opened(self) -> JobRunLog:
        self.dir.mkdir(parents=True, exist_ok=True)
        self.spec_path.write_text(yaml.safe_dump(self.job.model_dump(mode="json"), sort_keys=False))
        adoption.write_controller(self.dir, self.job_run_id, self.flow_run_id)
        if self.job.tracking.mlflow:
            self.tracker = Tracker(
                self.job, Where.of(self.job, self.settings.home, dict(os.environ)), self.job_run_id,
                self.flow_run_id, self.provider_name, self.mlflow_run_id, self._mlflow_attached,
            ).start()  # fmt: skip
            for r in self.records:  # an adopted run's attempts: the tags say which were already sent
                check = r.extra.get("resume_check")
                self.tracker.attempt(r, ResumeCheck(**check) if check else None)
        return self

    def _mlflow_attached(self, run_id: str) -> None:
        """The tracker's thread made or re-attached the MLflow run: SQL names it (a view: never fatal)."""
        try:
            self.store.set_mlflow_run(self.job_run_id, run_id)
        except Exception as e:  # a view of the run: never fatal
            logging.getLogger(__name__).warning("MLflow run id not recorded in SQL: %s", e)

    def _adopt(self, orphan: JobRunRow) -> None:
        """Continue a job run whose controller died: its attempts, budgets and numbering go on."""
        self.store.adopt_job_run(orphan.id, self.flow_run_id or None)
        self.adopted_from = orphan.flow_run_id or ""
        self.mlflow_run_id = orphan.mlflow_run_id
        self.records = adoption.to_records(self.store.attempts(job_run_id=orphan.id, limit=100_000))
        left = adoption.read_worker(self.dir)
        self.leftover = left if left is not None and left.job_run_id == orphan.id else None
        self.sink.log(logging.WARNING, f"adopting job run {orphan.id} of {self.job.name} from flow run "
                                       f"{orphan.flow_run_id}, whose controller died")  # fmt: skip

    def stop_leftover(self, provider: Provider) -> None:
        """After adoption: stop the worker the dead controller left (local: its pid file; EC2: its flow
        run's instances, by tag, from any host), record that attempt as lost (controller died), and let
        the next trainer take over its storage lease at once."""
        left, self.leftover = self.leftover, None
        worker_id = left.worker_id if left is not None else None
        if isinstance(provider, AwsProvider) and self.adopted_from:  # by tag: the file may be elsewhere
            swept = provider.stop_leftovers(self.adopted_from)
            worker_id = swept[-1] if swept else worker_id
        if left is not None and left.process is not None:
            adoption.stop_local_worker(left.process)
        if worker_id is None:
            return  # it died between attempts: nothing was in flight
        self.released = worker_id
        recorded = any(  # by a controller that adopted it and died too (a pid may be reused: the time)
            r.extra.get("controller_died") and r.worker_id == worker_id
            and (left is None or abs(r.started_at - left.started_at) < 1e-3)
            for r in self.records
        )  # fmt: skip
        if not recorded:
            self.record(self._lost_attempt(left, worker_id))
        adoption.clear_worker(self.dir)  # recorded: a later adoption must not count it again

    def _lost_attempt(self, left: adoption.WorkerInfo | None, worker_id: str) -> AttemptRecord:
        """The dead controller's attempt in flight, with the steps its trainer reached (its heartbeat)."""
        try:
            storage = open_storage(self.job.storage, self.job.s3)
            durable = read_latest(storage)
            beat = read_heartbeat(storage, worker_id)
        except StorageError as e:  # the row matters more than its step counts
            self.sink.log(logging.WARNING, f"cannot read the lost attempt's progress: {e}")
            durable, beat = None, None
        last_step = max(int((beat or {}).get("last_step") or 0), durable or 0)
        if left is None:
            left = adoption.WorkerInfo(self.job_run_id, self.adopted_from, worker_id, self.provider_name,
                                       len(self.records) + 1, time.time(), None)  # fmt: skip
        self.resume_step = durable
        return adoption.lost_attempt(left, len(self.records) + 1, self.adopted_from, last_step, durable,
                                     time.time())  # fmt: skip

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
        if self.tracker is not None:  # briefly: the emergency checkpoint's metrics, the run's status
            self.tracker.finish(str(end.status), timeout_s=INTERRUPTED_TRACKING_S)
        if not self.store.flush(timeout_s=5):
            logging.getLogger(__name__).warning(
                "history database unavailable: %d record(s) kept in the journal", self.store.pending
            )
        adoption.clear_controller(self.dir)

    def started(self, rec: Started) -> None:
        """A trainer said where it trains from: a warm start's source and whether it loaded, once, into
        the job run's lineage (its key's first attempt; a resumed one reports the same)."""
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
        """What the next trainer is told beyond the job file: with `checkpoint.every: auto`, how often
        this job's workers are reclaimed (its history on this provider, pulled towards the prior).
        `reclaimed_after_s`: the attempt in flight is being reclaimed (a replacement started at its
        notice), after this long: it counts too."""
        if self.job.checkpoint.every != "auto":
            return []
        try:
            rows = self.store.attempts(job=self.job.name)
        except StoreUnavailable as e:  # a database that is down never stops training: the prior then
            self.sink.log(logging.WARNING, f"no attempt history for the checkpoint interval: {e}")
            rows = []
        prior = self.job.checkpoint.mtbf_prior_s
        est = estimate_mtbf(rows, self.provider_name, prior, reclaimed_after_s=reclaimed_after_s)
        self.sink.log(logging.INFO, f"checkpoint interval planned for {est.describe()}")
        return ["--mtbf-s", f"{est.mtbf_s:.0f}"]

    def classify(self, worker: Worker, result: WatchResult) -> AttemptRecord:
        try:  # this job's marker, not another job's that the trainer refused (exit CONFIG_ERROR)
            done = completed_for(open_storage(self.job.storage, self.job.s3), self.job)
        except ConfigError:
            done = None
        except StorageError as e:  # the storage is down: the attempt is judged on its own ending
            self.sink.log(logging.WARNING, f"{COMPLETED} not read ({e}): the attempt counts as unfinished")
            done = None
        outcome, cause = classify(result, completed=done is not None)
        record = to_record(worker, result, outcome, cause, resumed_checkpoint=self._uri(result.resumed_from))
        if "cost" in result.facts:  # providers that rent machines price each attempt in their watch
            record.extra["cost"] = dict(result.facts["cost"])
        if result.started is not None and result.started.resharded_from is not None:
            record.extra["resharded"] = resharded(result.started.resharded_from, self.job.world_size)
        if result.started is not None and result.started.changes:  # resume.allow_changes: not bitwise
            record.extra["spec_changes"] = [asdict(c) for c in result.started.changes]
        if result.interval is not None:  # `every: auto`: the interval it settled on, and why
            iv = result.interval
            record.extra["checkpoint_interval"] = {
                "seconds": iv.seconds, "cost_s": iv.cost_s, "mtbf_s": iv.mtbf_s, "reason": iv.reason,
            }  # fmt: skip
        check = self._resume_check(worker, result, record.attempt)
        if check is not None:  # in the row: the verdict on this resume (docs/tracking.md)
            record.extra["resume_check"] = check.as_dict()
        if result.rejected:  # the trainer's own report of what it passed over: the one authority on resume
            record.extra["rejected"] = [list(r) for r in result.rejected]
            self.store.record_rejections(self.job_run_id, record.attempt, result.rejected)
        steps = list(result.step_times)
        if result.last_step and (not steps or steps[-1][1] < result.last_step):
            last_t = max((r.t for r in result.records()), default=result.ended_at)
            steps.append((last_t, result.last_step))  # step lines come once a second: add the last one
        self.traces.append(
            AttemptTrace(record.attempt, outcome.value, worker.started_at, result.ended_at,
                         steps, result.last_durable_step, result.resumed_from)
        )  # fmt: skip
        return record

    def _resume_check(self, worker: Worker, result: WatchResult, attempt: int) -> ResumeCheck | None:
        """Compare what this attempt and the one it took over from computed (tasks/tracking/fidelity.py)."""
        previous = next(
            (r for r in reversed(self.records) if r.outcome is not Outcome.PROVISION_FAILED), None
        )
        try:
            if self.checker is None:
                storage = open_storage(self.job.storage, self.job.s3)
                self.checker = ResumeChecker(storage, self.job.tracking.resume_rtol)
            return self.checker.check(worker, result, previous, attempt)
        except Exception as e:  # a check that cannot be made must not lose the attempt's row
            self.sink.log(logging.WARNING, f"resume check of attempt {attempt} not made: {e}")
            return None

    def provision_failed(self, attempt: int, error: ProvisionError, started_at: float) -> AttemptRecord:
        return provision_failed_record(attempt, self.provider_name, error, started_at, time.time())

    def resumed(self, point: ResumePoint) -> None:
        """The flow's estimate of the checkpoint the next attempt starts from (lost-steps accounting);
        what the trainer passed over reaches SQL from its `started` record (classify)."""
        self.resume_step, self.resume_uri = point.step, point.uri

    def record(self, record: AttemptRecord) -> None:
        # Lost steps count from the checkpoint the next attempt resumes from, once selected. A cancelled
        # or adopted attempt ends the run here: its own count (from its newest durable step) stands.
        if record.outcome is Outcome.CANCELLED or record.extra.get("controller_died"):
            pass
        elif record.outcome is not Outcome.COMPLETED and self.resume_step is not None:
            record.lost_steps = max(0, record.last_step - self.resume_step)
        elif record.outcome is not Outcome.COMPLETED:
            record.lost_steps = record.last_step
        self.records.append(record)
        self.store.record_attempt(self.job_run_id, record)
        if self._in_flight is not None and self._in_flight.attempt == record.attempt:
            self.in_flight = None
        check = ResumeCheck(**record.extra["resume_check"]) if "resume_check" in record.extra else None
        if check is not None:
            self._resume_checked(check)
        if self.tracker is not None:
            self.tracker.attempt(record, check)
        try:
            self.sink.attempts(self.job.name, self.records)
        except Exception as e:  # an artifact is a view; the row above is the record
            logging.getLogger(__name__).warning("attempts table artifact not updated: %s", e)

    def _resume_checked(self, check: ResumeCheck) -> None:
        """The verdict as a log line and an event; a mismatch's event carries the label automations match."""
        level = logging.WARNING if check.verdict == "mismatch" else logging.INFO
        self.sink.log(level, f"resume check, {check.line()}")
        payload = {**check.as_dict(), "checkpoint": self._uri(check.resumed_from) or "",
                   "flow_run_id": self.flow_run_id, "first_diff": check.first_diff or 0}  # fmt: skip
        self.sink.event(RESUME_CHECKED, self.job.name, payload, {VERDICT_LABEL: check.verdict})

    @property
    def resume_checks(self) -> list[dict[str, Any]]:
        return [r.extra["resume_check"] for r in self.records if "resume_check" in r.extra]

    def finish(self, status: str, message: str, wall_s: float) -> Summary:
        self.store.finish_job_run(self.job_run_id, status, message)  # first: the reports below are views
        ended = time.time()  # the job run's end as finish_job_run just stored it (to within a query);
        # not after MLflow's final sync and the timeline's PNG below (2.5 s in one demo run), which
        # made this summary's goodput lower than `spotrun report`'s for the same run
        trained = bool(self.records)  # not a flow run that found its key already completed
        tracking = self.tracker.finish(status) if self.tracker is not None and trained else None
        if self.tracker is not None and not trained:
            self.tracker.close()
        promotion = None
        if (
            status == "completed"
            and trained
            and (self.job.promote is not None or self.job.keep_runs is not None)
        ):
            tracked = tracking.promotion if tracking is not None else None
            promotion = after_completion(self.job, self.store, self.sink, job_run_id=self.job_run_id,
                                         flow_run_id=self.flow_run_id, tracked=tracked)  # fmt: skip
        try:
            timeline = self._timeline()
        except (OSError, StorageError) as e:  # a report that cannot be saved must not fail a finished job
            self.sink.log(logging.WARNING, f"timeline not saved: {e}")
            timeline = ""
        final = max((r.last_step for r in self.records), default=0)
        checks = self.resume_checks
        info = RunInfo(self.job.name, self.job_run_id, status, ended, gpus_per_worker=self.job.world_size)
        figures = goodput.compute(self.records, info, ended)  # what `spotrun report` computes from SQL
        # the wall time the goodput divides by (first attempt's start to the job's end), as the report's
        wall_s = figures.wall_s if figures.started_at is not None else wall_s
        summary = Summary(status, message, len(self.records), final, figures.goodput or 0.0,
                          wall_s, timeline, *total_cost(self.records),
                          report.checkpoint_interval(self.records), resume_checks=checks,
                          resume_fidelity=worst_verdict([c["verdict"] for c in checks]),
                          mlflow=tracking.as_dict() if tracking is not None else None,
                          run_key=self.job.run_key, promotion=promotion)  # fmt: skip
        png = (self.dir / "timeline.png").read_bytes() if timeline else None
        markdown = report.summary_markdown(self.job.name, status, self.records, figures, timeline, png)
        self.sink.summary(self.job.name, markdown + tracking_markdown(summary))
        if status == "completed":  # the last progress report came up to a second before the last step
            self.sink.progress(self.job.name, self.job.total_steps, self.job.total_steps)
        adoption.clear_controller(self.dir)
        if not self.store.flush(timeout_s=10):
            self.sink.log(
                logging.WARNING,
                f"history database still unavailable: {self.store.pending} record(s) wait in the journal "
                "and are written when it answers",
            )
        return summary

    def _timeline(self) -> str:
        png = plot_timeline(
            self.traces, f"{self.job.name}: training step over wall time", self.dir / "timeline.png"
        )
        if not is_local(self.job.storage):  # next to the checkpoints as well, where the team looks
            put_bytes(open_storage(self.job.storage, self.job.s3), "reports/timeline.png", png.read_bytes())
            return f"{self.job.storage.rstrip('/')}/reports/timeline.png"
        local = (
            Path(self.job.storage.removeprefix("file://")).expanduser().resolve() / "reports" / "timeline.png"
        )
        local.parent.mkdir(parents=True, exist_ok=True)
        local.write_bytes(png.read_bytes())
        return str(local)

    def _uri(self, step: int | None) -> str | None:
        return None if step is None else checkpoint_uri(self.job.storage, step)
