"""The training flow's controller with no trainer: `run_job` with the Prefect sink over the fake
provider (tests/fakes/provider.py), its attempts reclaimed with a notice as the spot simulator's are.

Everything the controller does against Prefect and the history database is real (the job's slot, task
runs, events, artifacts, log lines, SQL rows); only the worker is a script, its steps paced on the wall
clock (`pace_s` a step) so a run lasts as long as asked while costing no CPU. No torch is imported: on
2 cores a trainer per job would measure the trainers, not the controllers (docs/benchmarks.md).

    python -m tests.fakes.fake_flow JOB.json REPORT.json [--reclaims N] [--pace S]

runs one job in this process and writes what it measured of itself (CPU seconds, peak RSS, its
attempts' times) to REPORT.json; bench/scale.py starts one such process per job.
"""

from __future__ import annotations

import argparse
import json
import resource
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from prefect import flow, tags
from prefect.runtime import flow_run
from prefect.states import Completed, Failed, State

from spotrun.deployments.alert_parts import TRAINING_FLOW
from spotrun.deployments.automations import HEARTBEAT_TAG
from spotrun.tasks.control.loop import run_job
from spotrun.tasks.decisions.policy import RetryPolicy
from spotrun.tasks.ownership.endings import record_ending
from spotrun.tasks.ownership.job_slot import one_run_per_job
from spotrun.tasks.providers.base import LogCallback, StatusCallback, WatchResult, Worker
from spotrun.tasks.reports.prefect_sink import PrefectSink
from spotrun.tasks.settings import Settings
from spotrun.trainer.spec.job import JobSpec
from spotrun.trainer.telemetry.records import Record, Step
from tests.fakes.provider import Ending, FakeAttempt, FakeProvider


class PacedProvider(FakeProvider):
    """The fake provider, each step `pace_s` of wall time later than the one before (a sleep)."""

    def __init__(self, script: list[FakeAttempt], *, pace_s: float, checkpoint_every: int) -> None:
        super().__init__(script, checkpoint_every=checkpoint_every, step_s=max(pace_s, 1e-3))
        self.pace_s = pace_s

    def watch(
        self, worker: Worker, on_status: StatusCallback | None = None, on_log: LogCallback | None = None
    ) -> WatchResult:
        """As the fake's, ending when the controller sees the end (the script's clock runs slow under
        load): the history's gap to the next attempt is then the controller's own time."""
        result = super().watch(worker, on_status, on_log)
        result.ended_at = time.time()
        return result

    def _records(self, h: Any, clock: Any) -> Iterator[Record]:
        for rec in super()._records(h, clock):
            if isinstance(rec, Step) and self.pace_s:
                time.sleep(self.pace_s)
            yield rec


def reclaim_script(total_steps: int, reclaims: int) -> list[FakeAttempt]:
    """`reclaims` attempts each reclaimed with a notice after an equal share of the steps; then done."""
    share = total_steps // (reclaims + 1)
    return [FakeAttempt(until=share * (i + 1), ending=Ending.NOTICE) for i in range(reclaims)]


@flow(name=TRAINING_FLOW, on_cancellation=[record_ending], on_crashed=[record_ending])
@one_run_per_job
def fake_training(
    job: JobSpec,
    policy: RetryPolicy = RetryPolicy(),  # noqa: B008
    reclaims: int = 2,
    pace_s: float = 0.0,
) -> State:
    """Run `job` to its end on paced fake workers, each of the first `reclaims` attempts reclaimed."""
    settings = Settings.from_env()
    provider = PacedProvider(
        reclaim_script(job.total_steps, reclaims), pace_s=pace_s, checkpoint_every=job.checkpoint.every_steps
    )
    run_id = str(flow_run.get_id() or "")
    result = run_job(job, provider, policy, PrefectSink(), settings=settings, flow_run_id=run_id)
    state = Completed if result.completed else Failed
    return state(message=result.message, data=result.summary.as_dict())


def usage() -> dict[str, float]:
    """This process's CPU seconds (user + system) and peak resident memory (MB) so far."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return {"cpu_s": r.ru_utime + r.ru_stime, "peak_rss_mb": r.ru_maxrss / 1024}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="one fake-trainer job through the training flow")
    p.add_argument("job", type=Path)
    p.add_argument("report", type=Path)
    p.add_argument("--reclaims", type=int, default=2)
    p.add_argument("--pace", type=float, default=0.0, metavar="S")
    args = p.parse_args(argv)
    job = JobSpec.model_validate(json.loads(args.job.read_text()))
    imported = {**usage(), "t": time.time()}
    with tags(HEARTBEAT_TAG):
        state = fake_training(job, reclaims=args.reclaims, pace_s=args.pace, return_state=True)
    report = {
        "imported": imported,
        "ended": {**usage(), "t": time.time()},
        "completed": state.is_completed(),
        "message": state.message,
        "flow_run_id": str(state.state_details.flow_run_id or ""),
    }
    args.report.write_text(json.dumps(report))
    return 0 if state.is_completed() else 1


if __name__ == "__main__":
    raise SystemExit(main())
