"""Prefect tasks around the provider seam: provision a worker, train on it, release it."""

from __future__ import annotations

import time
from pathlib import Path
from uuid import UUID

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from tasks import reporting as report
from tasks.providers.base import Provider, WatchResult, Worker
from trainer.spec import JobSpec

PROGRESS_EVERY_S = 2.0


@task(name="provision", cache_policy=NO_CACHE)
def provision_worker(
    provider: Provider, job: JobSpec, attempt: int, spec_path: Path, released: str | None = None
) -> Worker:
    """Rent (or, locally, start) a worker running the trainer for this job. `released`: the worker this
    controller released last (or a dead controller left); the new trainer may take its lease at once."""
    extra = ["--lease-takeover", released] if released else []
    worker = provider.provision(job, attempt, spec_path, extra)
    get_run_logger().info("attempt %d: worker %s (%s) provisioned", attempt, worker.id, provider.name)
    return worker


@task(name="train", cache_policy=NO_CACHE)
def train_on_worker(provider: Provider, worker: Worker, job: JobSpec, progress: UUID | None) -> WatchResult:
    """Stream the worker's log and progress into this run until the worker is gone."""
    log = get_run_logger()
    last_update = 0.0

    def on_status(rec: dict[str, object]) -> None:
        nonlocal last_update
        kind = rec.get("kind")
        if kind == "started":
            log.info("training from %s", rec.get("checkpoint") or rec.get("resumed_from") or "scratch")
            rejected = rec.get("rejected")
            for r in rejected if isinstance(rejected, list) else []:
                log.warning("trainer passed over checkpoint step %s: %s", r.get("step"), r.get("reason"))
        elif kind == "durable":
            log.info("checkpoint step %s durable", rec.get("step"))
        elif kind == "stopping":
            log.warning("worker stopping on %s at step %s", rec.get("reason"), rec.get("step"))
        elif kind == "step" and progress is not None and time.monotonic() - last_update > PROGRESS_EVERY_S:
            last_update = time.monotonic()
            report.set_progress(progress, int(rec["step"]), job.total_steps)  # type: ignore[call-overload]

    def on_log(line: str) -> None:
        log.info("[%s] %s", worker.id, line.rstrip())

    return provider.watch(worker, on_status, on_log)


@task(name="release", cache_policy=NO_CACHE)
def release_worker(provider: Provider, worker: Worker) -> None:
    """Give the worker back; idempotent, and run also when the flow is cancelled or fails."""
    provider.release(worker)
