"""One real run of the resilient-training flow for bench/recovery.py, and what it leaves to read back.

The flow runs in this process against a local Prefect server, with the local provider (each worker a
`python -m spotrun.trainer` subprocess) and its spot simulator. Three records of the run are read afterwards,
none of them patched into the product:
  - the attempts, from the run's own SQL history (provision time, end seen, outcome, resume point,
    last step);
  - every step's wall time as the trainer itself stamped it, from the per-step metrics objects the
    trainers publish to storage once a checkpoint covers them (trainer/telemetry/metrics_log.py). Each step is
    written once, by the attempt whose work survived, and an attempt's first step carries no `sps`;
    so the surviving timeline shows each reclaim as one gap, timed on the trainers' clocks (ms);
  - each reclaim's moment, from the local provider's own log line (`spot simulator: ...`), emitted
    just before the SIGTERM or SIGKILL;
  - from the workers' log lines as the flow forwards them, stamped with the trainer's own clock
    (asctime, ms): each worker's first and last `step N/M` line (every log_every steps: the first step
    of an attempt whose steps did not survive, to within log_every steps) and its `lease ... taken`
    line (imports, recipe build and data load are done; checkpoint selection and restore follow).
"""

from __future__ import annotations

import json
import logging
import re
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prefect import get_client
from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId
from prefect.events.worker import EventsWorker
from prefect.logging.handlers import APILogWorker
from prefect.settings import PREFECT_API_URL, PREFECT_HOME, temporary_settings

from spotrun.flows.resilient_training import resilient_training
from spotrun.server import PrefectServer, patched_environ
from spotrun.tasks.history import HistoryStore
from spotrun.tasks.providers.local import LocalProviderConfig
from spotrun.trainer.spec.job import JobSpec
from spotrun.trainer.telemetry.metrics_log import PREFIX, parse_metrics_key

PROVIDER_LOGGER = "spotrun.tasks.providers.local.provider"  # where the simulator says what it does, and when
RUN_LOGGERS = ("prefect.flow_runs", "prefect.task_runs")  # where the flow forwards the workers' log lines
# trainer/__main__.py's log format, as the flow forwards it:
# "[local-123] 2026-01-02 03:04:05,678 INFO spotrun.trainer.session.loop: step 2000/6000 loss ..."
LOG_LINE = re.compile(
    r"^\[(?P<worker>[^\]]+)\] (?P<ts>\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(?P<ms>\d{3}) [A-Z]+ "
    r"(?:rank \d+ )?(?P<name>[\w.]+): (?P<msg>.*)$"
)
STEP_MSG = re.compile(r"^step (\d+)/")


@dataclass(frozen=True)
class Attempt:
    """One attempt's SQL row (epoch seconds)."""

    n: int
    worker_id: str
    started_at: float  # provision returned: the trainer process exists (at the notice, if prewarmed)
    ended_at: float  # watch returned: the process and its session are gone, seen by the flow
    outcome: str
    cause: str
    resumed_from: int | None
    last_step: int
    lost_steps: int


@dataclass(frozen=True)
class Reclaim:
    """What the spot simulator did to one worker, and when (its log record's time)."""

    worker_id: str
    at: float
    notice: bool
    after_s: float  # planned seconds of training before it


@dataclass(frozen=True)
class StepTime:
    t: float  # the trainer's wall clock right after the step
    first: bool  # the first step its attempt computed (no `sps`)


@dataclass
class FlowRun:
    label: str
    begin: float  # just before the flow was called
    end: float  # just after it returned
    state: str
    message: str
    attempts: list[Attempt]
    steps: dict[int, StepTime]
    reclaims: list[Reclaim]
    marks: dict[str, dict[str, float]] = field(default_factory=dict)
    """worker id -> first_step, first_step_t, last_step, last_step_t, lease_taken_t (from its log lines)"""
    tasks: list[tuple[str, float, float]] = field(default_factory=list)  # (task name, start, end)

    @property
    def wall_s(self) -> float:
        return self.end - self.begin


class _SimulatorLog(logging.Handler):
    """Keeps the local provider's `spot simulator:` records: (worker id, planned seconds) are their args."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.reclaims: list[Reclaim] = []

    def emit(self, record: logging.LogRecord) -> None:
        msg = record.msg
        if not (
            isinstance(msg, str) and msg.startswith("spot simulator:") and isinstance(record.args, tuple)
        ):
            return
        worker_id, after_s = record.args[0], record.args[1]
        self.reclaims.append(Reclaim(str(worker_id), record.created, "(SIGTERM)" in msg, float(after_s)))  # type: ignore[arg-type]


class _WorkerLines(logging.Handler):
    """Keeps the milestones of each worker's forwarded log lines (FlowRun.marks)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.marks: dict[str, dict[str, float]] = {}

    def emit(self, record: logging.LogRecord) -> None:
        m = LOG_LINE.match(record.getMessage())
        if m is None:
            return
        t = time.mktime(time.strptime(m["ts"], "%Y-%m-%d %H:%M:%S")) + int(m["ms"]) / 1000
        marks = self.marks.setdefault(m["worker"], {})
        step = STEP_MSG.match(m["msg"]) if m["name"] == "spotrun.trainer.session.loop" else None
        if step is not None:
            if "first_step" not in marks:
                marks |= {"first_step": int(step[1]), "first_step_t": t}
            marks |= {"last_step": int(step[1]), "last_step_t": t}
        elif m["name"] == "spotrun.trainer.preemption.lease" and " taken (token " in m["msg"]:
            marks.setdefault("lease_taken_t", t)


@contextmanager
def worker_lines() -> Iterator[_WorkerLines]:
    handler = _WorkerLines()
    for name in RUN_LOGGERS:
        logging.getLogger(name).addHandler(handler)
    try:
        yield handler
    finally:
        for name in RUN_LOGGERS:
            logging.getLogger(name).removeHandler(handler)


@contextmanager
def simulator_log() -> Iterator[_SimulatorLog]:
    logger = logging.getLogger(PROVIDER_LOGGER)
    handler, level = _SimulatorLog(), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield handler
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


@contextmanager
def prefect_server(home: Path) -> Iterator[PrefectServer]:
    """A local Prefect server (SQLite) for the length of the block, stopped however the block ends."""
    server = PrefectServer(home)
    try:
        server.start()
        yield server
    finally:
        # Prefect's log and event senders flush while the server still answers; left for exit, they
        # would retry against a closed port for minutes.
        APILogWorker.drain_all(timeout=10)
        EventsWorker.drain_all(timeout=10)
        server.stop()


def run_flow(
    server: PrefectServer, root: Path, label: str, *, job: JobSpec, cfg: LocalProviderConfig
) -> FlowRun:
    """One flow run of `job` with its own SPOTRUN_HOME and SQL history under `root`; timed around the call."""
    db = f"sqlite:///{root / 'history.db'}"
    env = {"SPOTRUN_HOME": str(root / "home"), "SPOTRUN_DATABASE_URL": db, **server.client_env()}
    api = {PREFECT_API_URL: server.api_url, PREFECT_HOME: str(server.home)}  # the auth string: from env
    with (
        patched_environ(**env),
        temporary_settings(updates=api),
        simulator_log() as sim,
        worker_lines() as lines,
    ):
        for handler in logging.getLogger().handlers:  # run logs still go to the API; errors here
            handler.setLevel(logging.ERROR)
        begin = time.time()
        state = resilient_training(job=job, provider=cfg, return_state=True)
        end = time.time()
        tasks = task_runs(state.state_details.flow_run_id)
    with HistoryStore.open(db) as store:
        rows = sorted(store.attempts(job=job.name), key=lambda a: a.attempt)
    attempts = [
        Attempt(
            n=a.attempt,
            worker_id=a.worker_id,
            started_at=a.started_at,
            ended_at=a.ended_at,
            outcome=a.outcome.value,
            cause=a.cause,
            resumed_from=a.resumed_from,
            last_step=a.last_step,
            lost_steps=a.lost_steps,
        )
        for a in rows
    ]
    return FlowRun(
        label=label,
        begin=begin,
        end=end,
        state=state.name or "",
        message=state.message or "",
        attempts=attempts,
        steps=read_steps(Path(job.storage)),
        reclaims=list(sim.reclaims),
        marks=dict(lines.marks),
        tasks=tasks,
    )


def task_runs(flow_run_id: Any) -> list[tuple[str, float, float]]:
    """(task name, start, end) of every task run of the flow run, as the server recorded them."""
    with get_client(sync_client=True) as client:
        runs = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))
    return [
        (r.name.rsplit("-", 1)[0], r.start_time.timestamp(), r.end_time.timestamp())
        for r in runs
        if r.start_time is not None and r.end_time is not None
    ]


def read_steps(storage: Path) -> dict[int, StepTime]:
    """Every surviving step's time from the metrics objects in a local storage directory. A step written
    twice (a resume from an older checkpoint than the newest whose metrics were written) keeps the
    later write: that attempt's work is the one that survived."""
    steps: dict[int, StepTime] = {}
    objects = sorted((storage / PREFIX).glob("step_*.jsonl"), key=lambda p: p.stat().st_mtime)
    for path in objects:
        if parse_metrics_key(f"{PREFIX}{path.name}") is None:
            continue
        for line in path.read_text().splitlines():
            entry = json.loads(line)
            steps[int(entry["step"])] = StepTime(float(entry["t"]), "sps" not in entry)
    return steps
