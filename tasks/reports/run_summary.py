"""The report at a job run's end: the Summary the flow returns, its markdown artifact and the timeline.

Every figure here is a view of the attempts' rows (the goodput is what `spotrun report` computes from
SQL, tasks/reports/goodput.py); the run log stores the rows first and asks for the report after, so a report
that cannot be made (a timeline that cannot be saved) never fails a finished job.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from spotrun.tasks.decisions.attempts import AttemptRecord
from spotrun.tasks.providers.base import WatchResult, Worker
from spotrun.tasks.reports import goodput
from spotrun.tasks.reports import reporting as report
from spotrun.tasks.reports.run_tracking import resume_checks
from spotrun.tasks.reports.timeline import AttemptTrace, plot_timeline
from spotrun.tasks.tracking import TrackingInfo, worst_verdict
from spotrun.trainer.errors import StorageError
from spotrun.trainer.spec.job import JobSpec
from spotrun.trainer.storage import put_bytes
from spotrun.trainer.storage.registry import is_local


@dataclass
class Summary:
    status: str
    message: str
    attempts: int
    final_step: int
    goodput: (
        float  # effective training time / wall time, as `spotrun report` (tasks/reports/goodput.py); 0: none
    )
    wall_s: float
    timeline: str
    cost_usd: float | None = None  # summed over attempts, where the provider prices them
    on_demand_usd: float | None = None  # the same instance hours at the on-demand price
    checkpoint_interval: dict[str, Any] | None = None  # `every: auto`: the last choice and why
    resume_checks: list[dict[str, Any]] = field(default_factory=list)  # one per resumed attempt checked
    resume_fidelity: str | None = None  # the worst verdict: exact, unchecked, close, mismatch (None: none)
    mlflow: dict[str, Any] | None = None  # the MLflow run (tasks.tracking.TrackingInfo); None: tracking off
    run_key: str | None = None  # a keyed job's run key
    promotion: dict[str, Any] | None = None  # the promotion gate's decision (tasks/decisions/promotion.py)

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass(frozen=True)
class Ending:
    """How the job run ended, as the run log stored it."""

    status: str
    message: str
    wall_s: float  # the flow's own measure; the goodput's wall time replaces it when there are attempts
    ended_at: float  # the job run's end as stored (before MLflow's final sync and the timeline's PNG)


class Sink(Protocol):
    def log(self, level: int, msg: str) -> None: ...

    def progress(self, job: str, step: int, total: int) -> None: ...

    def summary(self, job: str, markdown: str) -> None: ...


def total_cost(records: list[AttemptRecord]) -> tuple[float | None, float | None]:
    """(what the attempts cost, what the same hours cost on demand); None where any price is unknown."""
    costs = [r.extra["cost"] for r in records if "cost" in r.extra]
    if not costs:
        return None, None

    def total(key: str) -> float | None:
        values = [c.get(key) for c in costs]
        return None if any(v is None for v in values) else float(sum(values))

    return total("usd"), total("on_demand_usd")


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


def make_summary(
    end: Ending,
    records: list[AttemptRecord],
    figures: goodput.GoodputReport,
    *,
    timeline: str,
    tracking: TrackingInfo | None,
    promotion: dict[str, Any] | None,
    run_key: str | None,
) -> Summary:
    """The Summary of a job run from its attempts and its goodput figures."""
    checks = resume_checks(records)
    cost_usd, on_demand_usd = total_cost(records)
    return Summary(
        status=end.status,
        message=end.message,
        attempts=len(records),
        final_step=max((r.last_step for r in records), default=0),
        goodput=figures.goodput or 0.0,
        # the wall time the goodput divides by (first attempt's start to the job's end), as the report's
        wall_s=figures.wall_s if figures.started_at is not None else end.wall_s,
        timeline=timeline,
        cost_usd=cost_usd,
        on_demand_usd=on_demand_usd,
        checkpoint_interval=report.checkpoint_interval(records),
        resume_checks=checks,
        resume_fidelity=worst_verdict([c["verdict"] for c in checks]),
        mlflow=tracking.as_dict() if tracking is not None else None,
        run_key=run_key,
        promotion=promotion,
    )


def attempt_trace(record: AttemptRecord, worker: Worker, result: WatchResult) -> AttemptTrace:
    """One attempt's line on the timeline: its step samples, with its last step (step lines come once a
    second, so the last one may be missing)."""
    steps = list(result.step_times)
    if result.last_step and (not steps or steps[-1][1] < result.last_step):
        last_t = max((r.t for r in result.records()), default=result.ended_at)
        steps.append((last_t, result.last_step))
    return AttemptTrace(
        attempt=record.attempt,
        outcome=record.outcome.value,
        started_at=worker.started_at,
        ended_at=result.ended_at,
        steps=steps,
        durable_step=result.last_durable_step,
        resumed_from=result.resumed_from,
    )


class RunReport:
    """Collects the attempts' timeline traces of one job run and makes its report at the end."""

    def __init__(self, job: JobSpec, job_run_id: str, job_dir: Path, sink: Sink) -> None:
        self.job, self.job_run_id, self.dir, self.sink = job, job_run_id, job_dir, sink
        self.traces: list[AttemptTrace] = []

    def trace(self, record: AttemptRecord, worker: Worker, result: WatchResult) -> None:
        """Add an attempt that had a worker to the timeline."""
        self.traces.append(attempt_trace(record, worker, result))

    def summary(
        self,
        end: Ending,
        records: list[AttemptRecord],
        tracking: TrackingInfo | None,
        promotion: dict[str, Any] | None,
    ) -> Summary:
        """The Summary, published as the run's markdown artifact (with its final progress)."""
        timeline = self._saved_timeline()
        info = goodput.RunInfo(
            job=self.job.name,
            job_run_id=self.job_run_id,
            status=end.status,
            ended_at=end.ended_at,
            gpus_per_worker=self.job.world_size,
        )
        figures = goodput.compute(records, info, end.ended_at)  # what `spotrun report` computes from SQL
        summary = make_summary(
            end,
            records,
            figures,
            timeline=timeline,
            tracking=tracking,
            promotion=promotion,
            run_key=self.job.run_key,
        )
        png = (self.dir / "timeline.png").read_bytes() if timeline else None
        markdown = report.summary_markdown(
            self.job.name, end.status, records, rep=figures, timeline=timeline, timeline_png=png
        )
        self.sink.summary(self.job.name, markdown + tracking_markdown(summary))
        if end.status == "completed":  # the last progress report came up to a second before the last step
            self.sink.progress(self.job.name, self.job.total_steps, self.job.total_steps)
        return summary

    def _saved_timeline(self) -> str:
        """Where the timeline was saved ("" when it could not be: a report never fails a finished job)."""
        try:
            return self._timeline()
        except (OSError, StorageError) as e:
            self.sink.log(logging.WARNING, f"timeline not saved: {e}")
            return ""

    def _timeline(self) -> str:
        png = plot_timeline(
            self.traces, f"{self.job.name}: training step over wall time", self.dir / "timeline.png"
        )
        if not is_local(self.job.storage):  # next to the checkpoints as well, where the team looks
            put_bytes(self.job.open_storage(), "reports/timeline.png", png.read_bytes())
            return f"{self.job.storage.rstrip('/')}/reports/timeline.png"
        local = (
            Path(self.job.storage.removeprefix("file://")).expanduser().resolve() / "reports" / "timeline.png"
        )
        local.parent.mkdir(parents=True, exist_ok=True)
        local.write_bytes(png.read_bytes())
        return str(local)
