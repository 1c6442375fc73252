"""The controller's integrity check of a job's checkpoints: quarantine what storage lost, estimate the
resume point.

The trainer is the one authority on where an attempt resumes (it validates against the model it
built and reports its choice in its `started` record); the flow builds no recipe and runs no user
code. What it still does, through storage only: hash every committed checkpoint against its manifest,
quarantine the damaged ones (so no trainer resumes from an intact local copy of what storage lost),
and estimate the step the next attempt will start from, for lost-steps accounting.

The flow cache holds the copies an S3 store's checkpoints are hashed in. After each check it keeps
only the one found intact (the next check reuses it when no newer one came), so between checks it
holds at most one checkpoint's files; a full disk there is an alert and a skipped check, not a crash.
"""

from __future__ import annotations

import errno
import logging
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from spotrun.trainer.checkpoint.catalog import Catalog, prune_local, select_newest_valid
from spotrun.trainer.checkpoint.completion import completed_for
from spotrun.trainer.checkpoint.format import checkpoint_uri
from spotrun.trainer.checkpoint.signing import KEY_ENV
from spotrun.trainer.checkpoint.validate import Problem
from spotrun.trainer.errors import ConfigError, StorageError, TransientStorageError
from spotrun.trainer.spec.job import JobSpec

# a checkpoint whose signature the controller cannot check (trainer/checkpoint/signing.py):
# kept, not resumed from
CHECKPOINT_UNVERIFIED = "spotrun.checkpoint.unverified"
# the controller's disk filled up during the check: the check was skipped, its flow cache emptied
CONTROLLER_DISK_FULL = "spotrun.controller.disk-full"


class LogSink(Protocol):
    def log(self, level: int, msg: str) -> None: ...

    def event(
        self, name: str, job: str, payload: dict[str, Any], labels: dict[str, str] | None = None
    ) -> None: ...


@dataclass(frozen=True)
class CheckpointReport:
    step: int
    problems: tuple[str, ...]  # empty: intact
    # its signature cannot be checked with the keys held here (trainer/checkpoint/signing.py):
    # not a candidate, but never quarantined (a worker without the key, or an edited manifest,
    # is no proof of damage)
    unverified: bool = False

    @property
    def valid(self) -> bool:
        return not self.problems

    @property
    def damaged(self) -> bool:
        return bool(self.problems) and not self.unverified


@dataclass(frozen=True)
class ResumePoint:
    """The flow's estimate of where the next attempt starts; the trainer's `started` record is the fact."""

    step: int | None  # None: scratch
    uri: str | None
    rejected: tuple[tuple[int, str], ...]  # (step, reasons) of every newer checkpoint passed over


def validate_newest(job: JobSpec, cache: Path) -> list[CheckpointReport]:
    """The committed checkpoints under the job's storage, newest first, with their integrity problems,
    down to the first intact one. The resume point's estimate needs no older one, and each check is a
    fetch of the whole checkpoint into the cache (a download from S3) between two attempts: with
    `keep: 3` hashing all of them tripled that. An older damaged one is found when it is next in line."""
    catalog = Catalog(job.open_storage(), cache)
    reports = []
    for step, entry in sorted(catalog.list().items(), reverse=True):
        if not entry.committed:
            continue  # a partial write (or a quarantined checkpoint): never a candidate
        try:
            _, problems = catalog.validate(step, None, integrity_only=True, entry=entry)
        except FileNotFoundError:
            continue  # deleted by retention since the listing: not a candidate either
        unverified = any(p.kind == "unverified" for p in problems)
        damage = [p for p in problems if p.kind != "unverified"]
        if unverified and damage:  # damage as well: the unkeyed digests failed, a quarantine is due
            unverified, problems = False, damage
        reports.append(CheckpointReport(step, tuple(str(p) for p in problems), unverified))
        if not problems:
            break
    return reports


def choose(reports: list[CheckpointReport], storage_uri: str) -> ResumePoint:
    """Newest intact checkpoint, cascading back; scratch if none (the trainer's choice, barring structure)."""
    by_step = {r.step: [Problem("integrity", None, p) for p in r.problems] for r in reports}
    sel = select_newest_valid(list(by_step), lambda s: (None, by_step[s]))
    rejected = tuple((r.step, r.reason()) for r in sel.rejected)
    uri = checkpoint_uri(storage_uri, sel.step) if sel.step is not None else None
    return ResumePoint(sel.step, uri, rejected)


def check_integrity(job: JobSpec, cache: Path, sink: LogSink) -> ResumePoint:
    """Hash the newest committed checkpoints down to an intact one, quarantine the damaged ones on the
    way, estimate the next resume point."""
    reports = validate_newest(job, cache)
    catalog = Catalog(job.open_storage())
    damaged = [r for r in reports if r.damaged]
    for r in damaged:  # the trainer must not resume from a local copy of what storage lost
        reason = "; ".join(r.problems[:3])
        sink.log(logging.WARNING, f"checkpoint step {r.step} is damaged in storage, quarantined: {reason}")
        catalog.quarantine(r.step, reason)
    for r in reports:
        if r.unverified:
            sink.log(
                logging.ERROR,
                f"checkpoint step {r.step} {r.problems[0]}: kept, not resumed from; give the workers and "
                f"this controller the same {KEY_ENV} (docs/security.md, Signing)",
            )
            sink.event(CHECKPOINT_UNVERIFIED, job.name, {"step": r.step, "problem": r.problems[0]})
    point = choose(reports, job.storage)
    prune_local(cache, set() if point.step is None else {point.step})  # what the next check may reuse
    sink.log(
        logging.INFO,
        f"{len(damaged)} damaged checkpoint(s) quarantined; "
        f"the next attempt likely resumes from {point.uri or 'scratch'}",
    )
    return point


def disk_full(e: OSError) -> bool:
    """No space (or no quota) left where the flow cache is."""
    return e.errno in (errno.ENOSPC, errno.EDQUOT)


def empty_cache(cache: Path) -> None:
    """Remove every copy in the flow cache, a partial download's too: the next check fetches again."""
    shutil.rmtree(cache, ignore_errors=True)


def completed_at(job: JobSpec) -> int | None:
    """Before a run: the step at which `job` already finished in its storage (None: not yet), from one
    read of its COMPLETED.json. ConfigError, one line, when the storage refuses (no bucket, no
    credentials), cannot be reached, or holds another finished job (trainer/session/resume.py)."""
    try:
        return completed_for(job.open_storage(), job)
    except TransientStorageError as e:
        raise ConfigError(
            f"storage {job.storage} cannot be reached ({e}); check the URI, s3.endpoint_url and the network"
        ) from e
    except StorageError as e:
        raise ConfigError(f"storage {job.storage}: {e}") from e
