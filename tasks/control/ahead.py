"""Workers started ahead of their attempt, and the storage-lease handover to them: the replacement a
notice starts (on the market the deadline policy picks), the spot worker a move back from on-demand
starts, and the notes that tell the old and the new trainer when to hand over
(trainer/preemption/handover.py, trainer/preemption/lease.py)."""

from __future__ import annotations

import logging

from spotrun.tasks.control.market import BackToSpot, MarketChooser
from spotrun.tasks.control.prewarm import Prewarm
from spotrun.tasks.control.runlog import JobRunLog
from spotrun.tasks.control.sinks import Sink
from spotrun.tasks.providers.base import Market, Provider, Worker
from spotrun.trainer.errors import StorageError
from spotrun.trainer.preemption.handover import write_standby
from spotrun.trainer.preemption.lease import write_handoff
from spotrun.trainer.spec.job import JobSpec


def back_to_spot(
    chooser: MarketChooser | None, ahead: Prewarm | None, worker: Worker, *, runlog: JobRunLog, sink: Sink
) -> BackToSpot | None:
    """The on-demand worker's watch for a move back to spot (None: not on-demand, no deadline policy, or
    a provider that cannot start a worker ahead: then only the next provisioning asks)."""
    if chooser is None or ahead is None or worker.market != "on-demand":
        return None

    def args() -> list[str]:  # the spot trainer takes over the lease as a notice's replacement does
        announce(chooser.job, worker.id, sink)
        return runlog.trainer_args()

    return BackToSpot(chooser, ahead, runlog.records, args)


def replacement_for(
    provider: Provider,
    job: JobSpec,
    runlog: JobRunLog,
    *,
    attempt: int,
    now: Worker,
    chooser: MarketChooser | None,
) -> Prewarm:
    """The next attempt's worker, to be started (in a thread) when `now` reports it is stopping; with a
    deadline policy, for a spot worker, on the market the policy picks when spot is short (an on-demand
    worker's is the move back to spot: spot only)."""

    def plain(extra: list[str]) -> Worker:
        return provider.provision(job, attempt, runlog.spec_path, extra)

    if chooser is None or now.market == "on-demand":
        return Prewarm(plain, provider.release)

    def chosen(extra: list[str]) -> Worker:
        def launch(market: Market) -> Worker:
            return provider.provision(job, attempt, runlog.spec_path, extra, market=market)

        done = (now.result.last_durable_step if now.result is not None else None) or runlog.resume_step or 0
        worker, prewarm.reason = chooser.replacement(launch, runlog.records, done)
        return worker

    prewarm = Prewarm(chosen, provider.release)
    return prewarm


def announce(job: JobSpec, worker_id: str, sink: Sink) -> None:
    """Tell a noticed trainer that a replacement is on its way (trainer/preemption/handover.py)."""
    try:
        write_standby(job.open_storage(), worker_id, "starting")
    except (OSError, StorageError) as e:  # the trainer then stops after its announcement window
        sink.log(logging.WARNING, f"replacement for {worker_id} not announced: {e}")


def hand_off(job: JobSpec, worker_id: str, sink: Sink) -> None:
    """Tell a prewarmed trainer waiting on the lease that its holder is gone (trainer/preemption/lease.py)."""
    try:
        write_handoff(job.open_storage(), worker_id)
    except (OSError, StorageError) as e:  # it still gets the lease when the old one's expires
        sink.log(logging.WARNING, f"lease handoff for {worker_id} not written: {e}")
