"""Retention across a keyed job's runs: keep the newest `keep_runs` completed run keys, delete older ones.

A job with `run_key` writes each key's checkpoints under `<storage>/<key>/` (tasks/retraining/run_keys.py), so
a nightly job grows by one prefix a night. After a keyed run completes, the controller calls `prune_runs`:
the newest K keys that completed stay, and so does every key in flight (a running or recovering night)
and every protected key (the run the promotion alias holds, which tonight's and later runs evaluate; the
source of a running warm start, which a trainer may be reading). Older keys lose their whole prefix and
their per-key Prefect concurrency limit (`spotrun-job:<job>@<key>`, tasks/ownership/job_slot.py).

The choice is pure (`runs_to_prune`, tested with a table); deletion only ever touches a prefix that is
one key strictly below the job's base storage, and a failure is logged and reported, never raised: a
finished night must not fail over housekeeping. What it deleted is in the returned report (the history
keeps its rows: `spotrun history` still lists the run, without its checkpoints).
"""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from spotrun.trainer.errors import ConfigError
from spotrun.trainer.spec.job import JobSpec
from spotrun.trainer.spec.runs import key_problem
from spotrun.trainer.storage import open_storage
from spotrun.trainer.storage.base import normalize_uri
from spotrun.trainer.storage.local import LOCK_SUFFIX, LocalStorage
from spotrun.trainer.storage.registry import is_local

log = logging.getLogger(__name__)

COMPLETED, RUNNING = "completed", "running"  # tasks.history.JobStatus values


@dataclass(frozen=True)
class RunRecord:
    """One job run of a keyed job, as retention needs it (the lead maps history rows to it)."""

    job: str
    run_key: str | None  # None: an unkeyed run, never pruned here
    storage_uri: str  # the run's own storage: `<job's storage>/<run_key>`
    status: str  # running | completed | failed | cancelled | crashed
    started_at: float  # epoch seconds
    job_run_id: str = ""
    ended_at: float | None = None
    promoted: bool = False  # its promotion decision moved the alias (history's promotion["promoted"])
    lineage: dict[str, Any] | None = None  # history's lineage: the sources it was resolved against


@dataclass
class PruneReport:
    """What `prune_runs` did, for the log and the summary."""

    pruned: list[str] = field(default_factory=list)  # run keys whose prefix was deleted
    objects: int = 0  # objects deleted
    limits: list[str] = field(default_factory=list)  # concurrency limits deleted
    skipped: list[str] = field(default_factory=list)  # one line each: a key left alone, and why
    errors: list[str] = field(default_factory=list)  # one line each: a deletion that failed

    def line(self) -> str:
        """One line: 'retention: deleted 2 run key(s) (2026-12-01, 2026-12-02; 40 objects)'."""
        if not (self.pruned or self.skipped or self.errors):
            return "retention: nothing to delete"
        parts = [f"deleted {len(self.pruned)} run key(s)"]
        if self.pruned:
            parts[0] += f" ({', '.join(self.pruned)}; {self.objects} objects)"
        parts += [f"skipped {s}" for s in self.skipped] + [f"failed {e}" for e in self.errors]
        return "retention: " + "; ".join(parts)


def runs_to_prune(
    runs: Sequence[RunRecord], keep: int, in_flight: Iterable[str] = (), protected: Iterable[str] = ()
) -> list[RunRecord]:
    """The runs (every job run of each key) whose prefixes go, oldest first (pure).

    Keys are ordered by the start of the job run that completed them (the first to complete: a later
    rerun of a completed key finds it done and makes it no newer), a key that never completed by its
    first job run's start. The newest `keep` keys with a completed run stay;
    of the rest, only keys older than the oldest of those go, so a failed night newer than it stays (a
    recovery may continue it). Never a key in flight (`in_flight`, or a run of it still running), never
    a `protected` key. Fewer than `keep` completed keys: nothing goes."""
    if keep < 1:
        raise ConfigError(f"keep_runs is {keep}: keep at least 1 run key")
    by_key: dict[str, list[RunRecord]] = {}
    for r in runs:
        if r.run_key:
            by_key.setdefault(r.run_key, []).append(r)
    order = {k: (_rank(rs), k) for k, rs in by_key.items()}
    done = sorted(
        (k for k, rs in by_key.items() if any(r.status == COMPLETED for r in rs)),
        key=order.__getitem__,
        reverse=True,
    )
    if len(done) <= keep:
        return []
    oldest_kept = order[done[keep - 1]]
    live = set(in_flight) | {k for k, rs in by_key.items() if any(r.status == RUNNING for r in rs)}
    spared = live | set(protected) | set(done[:keep])
    gone = sorted((k for k in by_key if k not in spared and order[k] < oldest_kept), key=order.__getitem__)
    return [r for k in gone for r in sorted(by_key[k], key=lambda r: r.started_at)]


def _rank(runs: list[RunRecord]) -> float:
    done = [r.started_at for r in runs if r.status == COMPLETED]
    return min(done) if done else min(r.started_at for r in runs)


def lineage_keys(job: str, lineage: dict[str, Any] | None) -> set[str]:
    """The run keys of `job` a run's recorded lineage (tasks/retraining/run_keys.py Lineage.as_json) reads:
    its warm start's source and the champion it is compared with. Protect these for every run in flight."""
    keys = set()
    for role in ("init_from", "champion"):
        src = (lineage or {}).get(role)
        if isinstance(src, dict) and src.get("job") == job and src.get("run_key"):
            keys.add(str(src["run_key"]))
    return keys


def champion_key(runs: Sequence[RunRecord]) -> str | None:
    """The key the promotion alias holds: the newest completed run promoted (as `which: best` picks it,
    tasks/retraining/run_keys.py pick_source)."""
    held = [r for r in runs if r.promoted and r.status == COMPLETED and r.run_key]
    best = max(held, key=lambda r: (r.ended_at or r.started_at, r.started_at), default=None)
    return best.run_key if best is not None else None


def read_keys(job: str, runs: Sequence[RunRecord]) -> set[str]:
    """The keys of `job` that its running runs read (their warm start's source, their champion)."""
    return {k for r in runs if r.status == RUNNING for k in lineage_keys(job, r.lineage)}


def protected_keys(job: JobSpec) -> set[str]:
    """The keys a resolved spec itself reads: the champion it was compared with, its warm start's source
    (of the same job)."""
    sources = []
    if job.promote is not None and job.promote.champion is not None:
        sources.append(job.promote.champion)
    if job.init_from is not None and job.init_from.source is not None:
        sources.append(job.init_from.source)
    return {s.run_key for s in sources if s.job == job.name and s.run_key}


def base_storage(job: JobSpec) -> str:
    """The job's storage above its keys: a resolved spec's `<storage>/<key>` without the key."""
    if job.resolved and job.run_key and job.storage.rstrip("/").endswith("/" + job.run_key):
        return job.storage.rstrip("/")[: -len(job.run_key) - 1]
    return job.storage


def own_prefix_problem(run: RunRecord, base: str) -> str | None:
    """Why `run`'s storage is not exactly one key below `base` (None: it is, and may be deleted)."""
    if not run.run_key or key_problem(run.run_key):
        return f"run key {run.run_key!r} is not one path component"
    for uri in (base, run.storage_uri):
        if is_local(uri) and not uri.startswith(("file://", "/")):
            return f"storage {uri!r} is relative: give the absolute storage (Settings.resolve)"
    if normalize_uri(run.storage_uri) != f"{normalize_uri(base)}/{run.run_key}":
        return f"its storage {run.storage_uri} is not {base}/{run.run_key}"
    return None


def prune_runs(
    job: JobSpec,
    runs: Sequence[RunRecord],
    *,
    keep: int | None = None,
    in_flight: Iterable[str] = (),
    protected: Iterable[str] = (),
    delete_limit: Callable[[str], bool] | None = None,
) -> PruneReport:
    """Delete the prefixes (and per-key concurrency limits) of `job`'s run keys beyond `keep` (default
    `job.keep_runs`; None: keep all). `job`: the job's spec, resolved or not, with its storage absolute
    (Settings.resolve); `runs`: the job's job runs from the history. Never pruned, besides keys in flight:
    the key the alias holds (`champion_key`), what running runs read (`read_keys`), what `job` itself
    reads (`protected_keys`) and `protected`. Never raises: failures are in the report and the log."""
    report = PruneReport()
    keep = keep if keep is not None else job.keep_runs
    if keep is None:
        return report
    mine = [r for r in runs if r.job == job.name]
    spared = set(protected) | protected_keys(job) | read_keys(job.name, mine)
    if (held := champion_key(mine)) is not None:
        spared.add(held)
    base = base_storage(job)
    delete_limit = delete_limit or delete_slot_limit
    done: set[str] = set()
    for run in runs_to_prune(mine, keep, in_flight, spared):
        assert run.run_key is not None  # runs_to_prune returns keyed runs only
        if run.run_key in done:
            continue
        done.add(run.run_key)
        options = job.storage_options(run.storage_uri)
        _prune_one(job.name, run, base, options=options, delete_limit=delete_limit, report=report)
    if report.pruned or report.errors or report.skipped:
        log.info("%s", report.line())
    return report


def _prune_one(
    job: str,
    run: RunRecord,
    base: str,
    *,
    options: object,
    delete_limit: Callable[[str], bool],
    report: PruneReport,
) -> None:
    assert run.run_key is not None
    problem = own_prefix_problem(run, base)
    if problem is not None:
        report.skipped.append(f"{run.run_key}: {problem}")
        log.warning("retention: %s left alone: %s", run.run_key, problem)
        return
    try:
        deleted = delete_prefix(run.storage_uri, options)
    except Exception as e:  # storage down, permissions: housekeeping never fails a finished run
        report.errors.append(f"{run.run_key}: {type(e).__name__}: {e}")
        log.warning("retention: %s not deleted from %s: %s", run.run_key, run.storage_uri, e)
        return
    if deleted:  # 0: pruned on an earlier night (the history keeps its row), or it never wrote anything
        report.objects += deleted
        report.pruned.append(run.run_key)
    from spotrun.tasks.ownership.job_slot import limit_name, slot_id

    name = limit_name(slot_id(job, run.run_key))
    try:
        if delete_limit(name):
            report.limits.append(name)
    except Exception as e:  # no server, an outage: the limit is an empty slot, harmless but listed
        report.errors.append(f"{name}: {type(e).__name__}: {e}")
        log.warning("retention: concurrency limit %s not deleted: %s", name, e)


def delete_prefix(uri: str, options: object = None) -> int:
    """Delete every object of the storage `uri` (one run's prefix), opened with its backend's `options`
    (S3Options for s3://); returns how many. A local directory
    goes too, once nothing but lock files is left in it (nobody holds them: the run is not in flight)."""
    try:
        storage = open_storage(uri, options, create=False)
    except ConfigError:  # a local directory that is gone already
        return 0
    keys = [o.key for o in storage.list()]
    storage.delete(keys)
    storage.cleanup_incomplete(0)  # a killed writer's partial files; no writer is left
    if isinstance(storage, LocalStorage):
        _remove_if_only_locks(storage.root)
    return len(keys)


def _remove_if_only_locks(root: Path) -> None:
    left = [Path(d) / f for d, _, files in os.walk(root) for f in files]
    if all(p.name.endswith(LOCK_SUFFIX) for p in left):
        shutil.rmtree(root, ignore_errors=True)
    else:
        log.info("retention: %s kept: %d file(s) appeared in it meanwhile", root, len(left))


def delete_slot_limit(name: str) -> bool:
    """Delete a Prefect global concurrency limit by name; False when it does not exist or there is no
    server configured (an ephemeral server's limits end with it). Other errors raise."""
    from prefect import get_client
    from prefect.exceptions import ObjectNotFound
    from prefect.settings import PREFECT_API_URL

    if not PREFECT_API_URL.value():
        return False
    try:
        with get_client(sync_client=True) as client:
            client.delete_global_concurrency_limit_by_name(name)
    except ObjectNotFound:
        return False
    return True
