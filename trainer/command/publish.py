"""A script's own checkpoints, as spotrun checkpoints: publish one (copy, hash, manifest last, upload,
confirm, `latest`, retention) and restore the newest valid one into `{checkpoint_dir}` before the start.

The files are copied out of `{checkpoint_dir}` first (into the store's staging directory, or the local
cache for an object store): the script goes on writing and rotating its own checkpoints while the copy
uploads, and what is hashed is what is uploaded. Layout `directory` in the manifest
(trainer/checkpoint/manifest.py): validation checks digests, then content that needs no model
(trainer/checkpoint/foreign.py).
"""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

from spotrun.trainer.checkpoint.catalog import Catalog, Selection, apply_retention, write_latest
from spotrun.trainer.checkpoint.format import fsync_file
from spotrun.trainer.checkpoint.manifest import DIRECTORY, MANIFEST, FileEntry, Manifest, file_entry, step_dir
from spotrun.trainer.checkpoint.safe_names import contained
from spotrun.trainer.checkpoint.signing import keyring
from spotrun.trainer.command.layouts import Found
from spotrun.trainer.errors import ConfigError
from spotrun.trainer.saving.publish import Sidecars, upload, verify_remote
from spotrun.trainer.spec.job import JobSpec
from spotrun.trainer.storage import Storage, get_bytes

log = logging.getLogger(__name__)


def publish(
    found: Found,
    *,
    root: Path,
    storage: Storage,
    cache: Path,
    spec: JobSpec,
    world_size: int = 1,
    sidecars: Sidecars | None = None,
) -> Manifest:
    """Make `found` (files under `root`) a durable spotrun checkpoint of step `found.step`; returns its
    manifest. The store's `latest` moves only once every object is confirmed; retention then keeps the
    job's `checkpoint.keep` newest."""
    staging = storage.staging()
    parent = staging if staging is not None else cache / ".publish"
    tmp = parent / f".tmp-{step_dir(found.step)}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        key = keyring().signing
        files: dict[str, FileEntry] = {}
        for name in found.files:
            dst = contained(tmp, name)
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(contained(root, name), dst)
            fsync_file(dst)
            files[name] = file_entry(dst, key=key)
        manifest = Manifest(
            step=found.step,
            spec_hash=spec.spec_hash(),
            shape_hash=spec.shape_hash(world_size),
            world_size=world_size,
            files=files,
            layout=DIRECTORY,
        ).signed()
        (tmp / MANIFEST).write_bytes(manifest.to_json())
        fsync_file(tmp / MANIFEST)
        upload(storage, tmp, manifest, sidecars=sidecars, adopt=staging is not None)
        if staging is None:
            verify_remote(storage, manifest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        if staging is not None:
            shutil.rmtree(staging, ignore_errors=True)
    write_latest(storage, found.step)
    apply_retention(storage, found.step, spec.checkpoint.keep)
    log.info("published the script's %s checkpoint at step %d to %s", found.layout, found.step, storage.uri)
    return manifest


def restore(storage: Storage, *, cache: Path, into: Path) -> Selection:
    """Put the newest valid checkpoint's files back under `into` (emptied first), at the paths the
    script wrote them; the selection says which step and why newer ones were refused. A store that
    holds a recipe's or a loop's checkpoints is another kind of job's: refused in one line."""
    catalog = Catalog(storage, cache)
    committed = sorted((s for s, e in catalog.list().items() if e.committed), reverse=True)
    if committed and (layout := _layout(storage, committed[0])) != DIRECTORY:
        raise ConfigError(
            f"checkpoint step {committed[0]} in {storage.uri} was written by a recipe or a session "
            f"(layout {layout}), not by a command; use a new storage URI for this job"
        )
    selection = catalog.select(None)
    if into.exists():
        shutil.rmtree(into)
    into.mkdir(parents=True)
    if selection.step is None or selection.path is None:
        return selection
    manifest = Manifest.from_json((selection.path / MANIFEST).read_bytes(), selection.step)
    for name in sorted(manifest.files):
        dst = contained(into, name)
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(contained(selection.path, name), dst)
    return selection


def _layout(storage: Storage, step: int) -> str:
    """The layout a committed checkpoint's manifest names (`directory` when it cannot be read: the
    selection then says what is wrong with it)."""
    try:
        return Manifest.from_json(get_bytes(storage, f"{step_dir(step)}/{MANIFEST}"), step).layout
    except (ValueError, FileNotFoundError):
        return DIRECTORY
