"""Validate every checkpoint of a job and select the one to resume from (the trainer's own validator)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from trainer.catalog import fetch, list_checkpoints, quarantine, select_newest_valid
from trainer.ckpt_format import checkpoint_uri
from trainer.errors import ConfigError
from trainer.spec import JobSpec
from trainer.storage import open_storage
from trainer.validate import Expectation, validate_dir


@dataclass(frozen=True)
class CheckpointReport:
    step: int
    problems: tuple[str, ...]  # empty: valid
    damaged: bool = False  # integrity/structure/content problems, as opposed to another job's checkpoint

    @property
    def valid(self) -> bool:
        return not self.problems


@dataclass(frozen=True)
class ResumePoint:
    step: int | None  # None: scratch
    uri: str | None
    rejected: tuple[tuple[int, str], ...]  # (step, reasons) of every newer checkpoint passed over


def expectation_for(job: JobSpec) -> Expectation | None:
    """The recipe's model and optimizer shapes, built on CPU; None when the recipe cannot be built here."""
    try:
        return Expectation.for_spec(job)
    except ConfigError:
        return None


def validate_all(job: JobSpec, cache: Path) -> list[CheckpointReport]:
    """Every step directory under the job's storage, newest first, with the problems found."""
    storage = open_storage(job.storage, job.s3)
    expect = expectation_for(job)
    reports = []
    for step, listed in sorted(list_checkpoints(storage).items(), reverse=True):
        if not listed.committed:
            continue  # a partial write (or a quarantined checkpoint): never a candidate
        problems = validate_dir(fetch(storage, step, cache), expect)
        damaged = bool(problems) and all(p.kind != "compat" for p in problems)
        reports.append(CheckpointReport(step, tuple(str(p) for p in problems), damaged))
    return reports


def choose(reports: list[CheckpointReport], storage_uri: str) -> ResumePoint:
    """Newest valid checkpoint, cascading back; scratch if none (the trainer makes the same choice)."""
    by_step = {r.step: r for r in reports}
    sel = select_newest_valid(list(by_step), lambda s: (None, list(by_step[s].problems)))  # type: ignore[arg-type]
    rejected = tuple((r.step, r.reason()) for r in sel.rejected)
    uri = checkpoint_uri(storage_uri, sel.step) if sel.step is not None else None
    return ResumePoint(sel.step, uri, rejected)


@task(name="validate-checkpoints", cache_policy=NO_CACHE, retries=2, retry_delay_seconds=2)
def validate_checkpoints(job: JobSpec, cache: Path) -> list[CheckpointReport]:
    """Integrity, structure and content of every checkpoint under the job's storage."""
    reports = validate_all(job, cache)
    log = get_run_logger()
    for r in reports:
        log.info("checkpoint step %d: %s", r.step, "valid" if r.valid else "; ".join(r.problems[:3]))
    return reports


@task(name="select-checkpoint", cache_policy=NO_CACHE)
def select_checkpoint(reports: list[CheckpointReport], job: JobSpec) -> ResumePoint:
    """Pick the newest valid checkpoint, quarantine the damaged newer ones, say why they were passed over."""
    point = choose(reports, job.storage)
    log = get_run_logger()
    damaged = {r.step for r in reports if r.damaged}
    for step, why in point.rejected:
        log.warning("rejected checkpoint step %d: %s", step, why)
        if step in damaged:  # the trainer must not resume from a local copy of what storage lost
            quarantine(open_storage(job.storage, job.s3), step, why)
    log.info("next attempt resumes from %s", point.uri or "scratch (no valid checkpoint)")
    return point
