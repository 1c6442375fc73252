"""What checkpoints exist under a storage root, which one to resume from, and which to delete.

`Catalog` is the one home for reading and pruning the timeline. Policy lives in pure functions
(`select_newest_valid`, `plan_retention`) that tests drive with tables; the rest moves bytes.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from spotrun.trainer.checkpoint.format import (
    LATEST,
    MANIFEST,
    REJECTED,
    Manifest,
    checkpoint_uri,
    parse_step_dir,
    step_dir,
)
from spotrun.trainer.checkpoint.safe_names import contained
from spotrun.trainer.checkpoint.signing import marker_problem, sign_marker
from spotrun.trainer.checkpoint.validate import Expectation, Problem, validate_dir
from spotrun.trainer.storage import Storage, get_bytes, put_bytes

log = logging.getLogger(__name__)

STEP_PREFIX = step_dir(0).rstrip("0")  # "step_": every step directory's name starts with it


@dataclass
class Listed:
    step: int
    files: dict[str, int] = field(default_factory=dict)  # name -> size
    newest_mtime: float = 0.0  # the newest file's time, as the store reports it

    @property
    def committed(self) -> bool:
        return MANIFEST in self.files


def list_checkpoints(storage: Storage) -> dict[int, Listed]:
    """Every step directory under the root, committed (has a manifest) or not. Lists only the step
    directories (`step_*`), never the whole root: what else a job keeps there (metrics objects, markers,
    the lease) must not make every retention and every tracker round cost more as the job grows."""
    found: dict[int, Listed] = {}
    for obj in storage.list(STEP_PREFIX):
        head, _, name = obj.key.partition("/")
        step = parse_step_dir(head)
        if step is None or not name:
            continue
        entry = found.setdefault(step, Listed(step))
        entry.files[name] = obj.size
        entry.newest_mtime = max(entry.newest_mtime, obj.mtime)
    return found


def read_marker(storage: Storage, key: str) -> tuple[int, dict[str, Any]] | None:
    """The step a JSON marker (`latest`, `COMPLETED.json`) names, and the whole marker; None when
    absent, malformed, or (with SPOTRUN_MANIFEST_KEY) not signed by a key held here."""
    try:
        marker = json.loads(get_bytes(storage, key))
        step = int(marker["step"])
    except FileNotFoundError:
        return None
    except (ValueError, KeyError, TypeError):
        log.warning("ignoring a malformed %s marker in %s", key, storage.uri)
        return None
    problem = marker_problem(marker)
    if problem is not None:
        log.warning("ignoring the %s marker in %s: %s", key, storage.uri, problem)
        return None
    return step, marker


def read_marker_step(storage: Storage, key: str) -> int | None:
    """The step a JSON marker names; None when absent or malformed."""
    found = read_marker(storage, key)
    return found[0] if found is not None else None


def write_marker(storage: Storage, key: str, body: dict[str, Any]) -> None:
    """A JSON marker, signed when SPOTRUN_MANIFEST_KEY is set."""
    put_bytes(storage, key, json.dumps(sign_marker(body)).encode())


def read_latest(storage: Storage) -> int | None:
    """The step `latest` names: only a hint, never trusted over validation."""
    return read_marker_step(storage, LATEST)


def write_latest(storage: Storage, step: int) -> None:
    write_marker(storage, LATEST, {"step": step, "dir": step_dir(step)})


def fetch(storage: Storage, step: int, cache: Path | None) -> Path:
    """Download one checkpoint into `cache/step_dir` (manifest last), reusing an identical local copy.
    A directory store's checkpoint is read where it is (no cache needed): a copy would only cost a
    second write of every byte (1 GB: 1-2 s) before the same validation reads them. FileNotFoundError
    when its manifest is gone (retention since the listing, as a download would find)."""
    name = step_dir(step)
    in_place = storage.local_path(name)
    if in_place is not None:
        if not (in_place / MANIFEST).is_file():
            raise FileNotFoundError(f"{storage.uri}/{name}/{MANIFEST}")
        return in_place
    if cache is None:
        raise ValueError("Catalog needs a cache directory to fetch into")
    dst = cache / name
    remote_manifest = get_bytes(storage, f"{name}/{MANIFEST}")
    if (dst / MANIFEST).is_file() and (dst / MANIFEST).read_bytes() == remote_manifest:
        return dst  # same bytes committed locally (we wrote it, or fetched it before); validation hashes it
    tmp = cache / f".fetch-{name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:  # names and step first (trainer/checkpoint/safe_names.py): a refused manifest fetches nothing else
        listed = Manifest.from_json(remote_manifest, step).files
    except ValueError:
        listed = {}  # validation reports why
    for fname in listed:
        try:
            storage.get(f"{name}/{fname}", contained(tmp, fname))
        except FileNotFoundError:
            continue  # validation reports it as missing
    (tmp / MANIFEST).write_bytes(remote_manifest)
    shutil.rmtree(dst, ignore_errors=True)
    os.replace(tmp, dst)
    return dst


MAX_REPORTED = 20  # rejections in one status line: the newest ones explain the choice
REASON_CHARS = 300
# Catalog.list shadows the builtin in its class body's annotations
Steps = list[int]
Problems = list[Problem]


@dataclass(frozen=True)
class Rejection:
    step: int
    problems: tuple[Problem, ...]

    def reason(self) -> str:
        return "; ".join(str(p) for p in self.problems[:3])


@dataclass
class Selection:
    step: int | None
    path: Path | None = None
    rejected: list[Rejection] = field(default_factory=list)
    uri: str | None = None  # the chosen checkpoint's directory URI
    world_size: int | None = None  # ranks that wrote it (its manifest)

    def describe(self, uri: str, into: str | None = None) -> str:
        """The one resume line: where from (`uri`, the storage selected from), and `into` the job's own
        storage when that is another one (a fork: `--resume-from OTHER --storage NEW`)."""
        rej = "".join(f"; rejected step {r.step}: {r.reason()}" for r in self.rejected)
        fork = f", into {into}" if into is not None and into != uri else ""
        if self.step is None:
            return f"no valid checkpoint in {uri}, starting from scratch{rej}"
        return f"resuming from step {self.step} of {uri}{fork}{rej}"

    def rejected_records(self, most: int = MAX_REPORTED) -> list[dict[str, Any]]:
        """The rejections as the `started` status record carries them: newest first, reasons cut short."""
        return [{"step": r.step, "reason": r.reason()[:REASON_CHARS]} for r in self.rejected[:most]]


def select_newest_valid(
    steps: list[int], check: Callable[[int], tuple[Path | None, list[Problem]]]
) -> Selection:
    """Walk from the newest step back to the first one `check` finds no problems with."""
    rejected: list[Rejection] = []
    for step in sorted(steps, reverse=True):
        path, problems = check(step)
        if not problems:
            return Selection(step, path, rejected)
        rejected.append(Rejection(step, tuple(problems)))
    return Selection(None, None, rejected)


class Catalog:
    """The checkpoints under one storage root: list, validate, select, quarantine, retain.

    The one place that reads the timeline: the trainer selects its resume point with it (the only
    authority on resume), the flow checks integrity and quarantines with it, `spotrun checkpoints`
    lists with it. `cache` is local disk for the copies `validate` hashes; only reads need it."""

    def __init__(self, storage: Storage, cache: Path | None = None) -> None:
        self.storage, self.cache = storage, cache

    def list(self) -> dict[int, Listed]:
        """Every step directory, committed or not."""
        return list_checkpoints(self.storage)

    def latest(self) -> int | None:
        return read_latest(self.storage)

    def uri(self, step: int) -> str:
        return checkpoint_uri(self.storage.uri, step)

    def fetch(self, step: int) -> Path:
        """One committed checkpoint's files in the cache (an identical copy there is reused), or in
        place for a directory store."""
        return fetch(self.storage, step, self.cache)

    def validate(
        self,
        step: int,
        expect: Expectation | None,
        *,
        integrity_only: bool = False,
        entry: Listed | None = None,
    ) -> tuple[Path | None, Problems]:
        """Fetch one checkpoint into the cache and validate it: integrity alone, or with the content
        checks and `expect` (structure, shape hash). `entry`: its listing, when the caller has one."""
        entry = entry if entry is not None else self.list().get(step)
        if entry is None:
            return None, [Problem("integrity", None, "no such checkpoint")]
        if not entry.committed:
            return None, [self._uncommitted(entry)]
        path = self.fetch(step)
        return path, validate_dir(path, expect, integrity_only)

    def select(
        self, expect: Expectation | None, only_step: int | None = None, *, integrity_only: bool = False
    ) -> Selection:
        """The newest valid checkpoint (or exactly `only_step`), fetched, and why newer ones were refused."""
        listed = self.list()
        if only_step is not None:
            listed = {only_step: listed[only_step]} if only_step in listed else {}
        sel = select_newest_valid(
            list(listed), lambda s: self.validate(s, expect, integrity_only=integrity_only, entry=listed[s])
        )
        sel.uri = self.uri(sel.step) if sel.step is not None else None
        return sel

    def quarantine(self, step: int, reasons: str) -> None:
        """Take a damaged checkpoint out of the timeline without destroying the evidence: its manifest
        moves into REJECTED.json (with the reasons), so no reader sees it as committed again (a trainer
        with an intact local copy would otherwise resume from a step whose durable copy is broken).
        Retention deletes it later, like any partial write older than the newest verified step."""
        name = step_dir(step)
        try:
            manifest = get_bytes(self.storage, f"{name}/{MANIFEST}").decode(errors="replace")
        except FileNotFoundError:
            return
        body = {"step": step, "reasons": reasons, "rejected_at": time.time(), "manifest": manifest}
        put_bytes(self.storage, f"{name}/{REJECTED}", json.dumps(body).encode())
        self.storage.delete([f"{name}/{MANIFEST}"])
        log.warning("quarantined checkpoint step %d in %s: %s", step, self.storage.uri, reasons)

    def retain(self, verified: int, keep: int, orphan_age_s: float = 3600.0) -> Steps:
        """Delete what plan_retention says, manifest first (so a half-deleted one is never a checkpoint)."""
        listed = self.list()
        committed = [s for s, c in listed.items() if c.committed]
        # an incomplete directory only once it is old: a listing that lags a write may not show a
        # manifest that exists (and a partial write younger than that may still be committing)
        cutoff = time.time() - orphan_age_s
        incomplete = [s for s, c in listed.items() if not c.committed and c.newest_mtime <= cutoff]
        doomed = plan_retention(committed, incomplete, verified, keep)
        # a directory listed without a manifest may have one the listing missed: committed after all
        doomed = [s for s in doomed if listed[s].committed or not self._has_manifest(step_dir(s))]
        # manifests first, all in one call, then the rest: a step is never half deleted yet committed, and a
        # backlog of thousands costs one DeleteObjects request per 1,000 keys, not two calls per step
        for keys in (
            [f"{step_dir(s)}/{MANIFEST}" for s in doomed if listed[s].committed],
            [f"{step_dir(s)}/{f}" for s in doomed for f in listed[s].files if f != MANIFEST],
        ):
            if keys:
                self.storage.delete(keys)
        if doomed:
            shown = doomed if len(doomed) <= 10 else f"{doomed[0]}..{doomed[-1]}"
            log.info("retention: deleted %d step(s) %s from %s", len(doomed), shown, self.storage.uri)
        self.storage.cleanup_incomplete(orphan_age_s)
        return doomed

    def _has_manifest(self, name: str) -> bool:
        try:
            get_bytes(self.storage, f"{name}/{MANIFEST}")
        except FileNotFoundError:
            return False
        return True

    def _uncommitted(self, entry: Listed) -> Problem:
        """Why a directory without a manifest is no checkpoint: quarantined (with the reasons), or partial."""
        if REJECTED in entry.files:
            try:
                body = json.loads(get_bytes(self.storage, f"{step_dir(entry.step)}/{REJECTED}"))
                return Problem("integrity", None, f"quarantined: {body['reasons']}")
            except (FileNotFoundError, ValueError, KeyError, TypeError):
                pass  # deleted by retention since the listing, or unreadable: a partial write all the same
        return Problem("integrity", MANIFEST, "missing manifest (incomplete or interrupted write)")


def plan_retention(committed: list[int], incomplete: list[int], verified: int, keep: int) -> list[int]:
    """Steps to delete, given the newest verified step.

    Keeps the newest `keep` committed checkpoints at or below `verified` (the newest may still be the
    only durable one while the next uploads: keep >= 2). Never touches anything newer than `verified`:
    it may be in flight. Incomplete directories older than `verified` are partial writes."""
    if keep < 2:
        raise ValueError("keep must be >= 2")
    eligible = sorted((s for s in committed if s <= verified), reverse=True)
    doomed = eligible[keep:]
    doomed += [s for s in incomplete if s < verified]
    return sorted(set(doomed))


def apply_retention(storage: Storage, verified: int, keep: int, orphan_age_s: float = 3600.0) -> list[int]:
    """Catalog(storage).retain(...), for the checkpointer's upload thread."""
    return Catalog(storage).retain(verified, keep, orphan_age_s)


def prune_local(cache: Path, keep_steps: set[int]) -> None:
    """Remove local checkpoint copies not in `keep_steps`, and stale temp directories."""
    if not cache.is_dir():
        return
    for d in cache.iterdir():
        step = parse_step_dir(d.name)
        stale_tmp = d.name.startswith((".tmp-", ".fetch-")) and time.time() - d.stat().st_mtime > 3600
        if (step is not None and step not in keep_steps) or stale_tmp:
            (d / MANIFEST).unlink(missing_ok=True)
            shutil.rmtree(d, ignore_errors=True)
