"""Watching one worker: its status records and log lines reach the sink (progress, log lines) and the
controller's callbacks (`WatchCalls`: the notice, the first record, each step, a rebalance), with the
progress watchdog guarding the watch; a callback may end the attempt on purpose (`StopWorker`)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from spotrun.tasks.control.sinks import Sink
from spotrun.tasks.control.watchdog import ProgressWatchdog, watched
from spotrun.tasks.decisions.outcome import resharded
from spotrun.tasks.providers.base import Provider, StopWorker, WatchResult, Worker, stopped
from spotrun.trainer.spec.job import JobSpec
from spotrun.trainer.telemetry.records import Durable, Notice, Record, Started, Step, Stopping

PROGRESS_EVERY_S = 2.0


@dataclass(frozen=True)
class WatchCalls:
    """What the controller does as a worker's records arrive (each optional)."""

    stopping: Callable[[], None] | None = None  # a stop request or a cloud notice: the worker goes away
    started: Callable[[Started], None] | None = None  # the first status record: where it trains from
    step: Callable[[int], None] | None = None  # each step, with the newest durable step (may `StopWorker`)
    rebalance: Callable[[Notice], None] | None = None  # a notice that is no stop (EC2's rebalance)


def watch(
    provider: Provider,
    worker: Worker,
    job: JobSpec,
    sink: Sink,
    calls: WatchCalls | None = None,
    dog: ProgressWatchdog | None = None,
) -> WatchResult:
    """Stream the worker's log and progress to the sink until the worker is gone, calling `calls` on
    the way; `dog` kills a worker that stops making progress (tasks/control/watchdog.py)."""
    calls = calls or WatchCalls()
    last_update = 0.0
    durable = 0
    trainer_log = False  # the provider streams the trainer's log, which says when a checkpoint is durable

    def on_status(rec: Record) -> None:
        nonlocal last_update, durable
        if isinstance(rec, Durable):
            durable = max(durable, rec.step)
        if dog is not None:
            dog.observe(rec)
        if isinstance(rec, Started):
            sink.log(logging.INFO, f"training from {rec.checkpoint or rec.resumed_from or 'scratch'}")
            for r in rec.rejected:
                sink.log(logging.WARNING, f"trainer passed over checkpoint step {r.step}: {r.reason}")
            if rec.resharded_from is not None:
                sink.log(logging.WARNING, f"resumed {resharded(rec.resharded_from, job.world_size)}")
            if rec.changes:  # allowed by resume.allow_changes: the run's numbers part from here
                changed = ", ".join(f"{c.field} {c.old} -> {c.new}" for c in rec.changes)
                sink.log(logging.WARNING, f"resumed with changed training settings ({changed}): not bitwise")
            if calls.started is not None:
                calls.started(rec)
        elif isinstance(rec, Durable) and not trainer_log:  # once: EC2 streams no log, the status says it
            sink.log(logging.INFO, f"checkpoint step {rec.step} durable")
        elif isinstance(rec, Stopping):
            sink.log(logging.WARNING, f"worker stopping on {rec.reason} at step {rec.step}")
            if calls.stopping is not None:
                calls.stopping()
        elif isinstance(rec, Notice) and rec.stop and calls.stopping is not None:
            calls.stopping()
        elif isinstance(rec, Notice) and not rec.stop and calls.rebalance is not None:
            calls.rebalance(rec)
        elif isinstance(rec, Step):
            durable = max(durable, rec.durable_step or 0)
            if calls.step is not None:
                calls.step(durable)
            if time.monotonic() - last_update > PROGRESS_EVERY_S:
                last_update = time.monotonic()
                sink.progress(job.name, rec.step, job.total_steps)

    def on_log(line: str) -> None:
        nonlocal trainer_log
        trainer_log = True
        sink.log(logging.INFO, f"[{worker.id}] {line.rstrip()}")

    try:
        return watched(provider, worker, dog, on_status=on_status, on_log=on_log)
    except StopWorker as e:  # a planned end: the provider stopped the worker as for a cancel
        sink.log(logging.INFO, f"{worker.id}: {e}")
        return stopped(provider, worker, e.cause)
