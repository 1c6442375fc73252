"""Publishing one checkpoint, from its snapshot to durable: write the step directory, upload it with its
sidecars (manifest last), confirm every object against the manifest, move `latest`.

What the writer thread (trainer/saving/checkpointer.py), the writer process (trainer/saving/writer_proc.py)
and the sharded checkpointer (trainer/saving/sharded.py) share; below all three, so that none imports
another for it.
"""

from __future__ import annotations

import logging
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from spotrun.trainer.checkpoint.catalog import write_latest
from spotrun.trainer.checkpoint.format import MANIFEST, Manifest, step_dir, write_checkpoint_dir
from spotrun.trainer.errors import CheckpointError, LeaseLost, StorageError, TransientStorageError
from spotrun.trainer.storage import Storage, confirm_stored, put_bytes
from spotrun.trainer.storage.local import unwritable

log = logging.getLogger(__name__)

Sidecars = dict[str, bytes]  # storage key -> content


@dataclass(frozen=True)
class Persisted:
    manifest: Manifest
    write_s: float
    upload_s: float
    verify_s: float
    sidecars_written: bool

    @property
    def nbytes(self) -> int:
        """The checkpoint's files, as the manifest lists them."""
        return sum(f.size for f in self.manifest.files.values())


def persist(
    storage: Storage, cache: Path, snap: dict[str, Any], *, base: dict[str, Any], sidecars: Sidecars
) -> Persisted:
    """One checkpoint from snapshot to durable: write the step directory (fsynced, hashed as written,
    manifest last), upload it with its sidecars (manifest last), confirm it, move `latest`. What the
    writer thread and the writer process both run.

    A storage with a staging directory (a local or network directory) is written once, in place, and
    each file renamed into its key: no copy in the local cache, no second pass over the bytes, nothing
    to read back (each file is the bytes hashed as they were written), and around the page cache
    (trainer/storage/direct_io.py). Elsewhere the directory is written to `cache`, uploaded, and confirmed
    against the manifest."""
    staging = storage.staging()
    if staging is None:
        t0 = time.perf_counter()
        local, manifest = write_checkpoint_dir(cache, snap, base)
        t1 = time.perf_counter()
        written = upload(storage, local, manifest, sidecars=sidecars)
        t2 = time.perf_counter()
        verify_remote(storage, manifest)
    else:
        try:
            t0 = time.perf_counter()
            try:
                local, manifest = write_checkpoint_dir(staging, snap, base, direct=True)
            except OSError as e:
                mapped = refused(e, storage)
                if mapped is None:
                    raise
                raise mapped from e
            t1 = time.perf_counter()
            written = upload(storage, local, manifest, sidecars=sidecars, adopt=True)
            t2 = time.perf_counter()
        finally:  # adopted, or a failed write's remains: nothing of it may stay in the store
            shutil.rmtree(staging, ignore_errors=True)
    write_latest(storage, manifest.step)
    return Persisted(manifest, t1 - t0, t2 - t1, verify_s=time.perf_counter() - t2, sidecars_written=written)


def refused(e: BaseException, storage: Storage) -> StorageError | None:
    """A full or read-only store met while writing into its staging directory, as the store's own
    one-line, not-retried StorageError (what its own writes raise); None for anything else (an I/O
    error passes as it is). DCP collects each rank's failure into a CheckpointException: looked into."""
    causes = [e, *(exc for exc, _ in getattr(e, "failures", {}).values())]
    for cause in causes:
        if isinstance(cause, StorageError) and not isinstance(cause, TransientStorageError):
            return cause
        if isinstance(cause, OSError):
            mapped = unwritable(cause, f"cannot write a checkpoint in storage {storage.uri}")
            if mapped is not None:
                return mapped
    return None


def upload(
    storage: Storage,
    local: Path,
    manifest: Manifest,
    *,
    sidecars: Sidecars | None = None,
    adopt: bool = False,
) -> bool:
    """Upload a checkpoint directory (or, with `adopt`, rename it into the storage from its staging
    directory), then its sidecars, manifest last. An older manifest for the same step (a rejected
    checkpoint from an earlier attempt) is deleted first, so no mix of old and new is ever committed.
    Returns whether the sidecars were written."""
    name = step_dir(manifest.step)
    storage.delete([f"{name}/{MANIFEST}"])
    files = [(f"{name}/{fname}", local / fname) for fname in sorted(manifest.files)]
    if adopt:
        storage.adopt(files)
    else:
        for key, src in files:
            storage.put(key, src)
    written = put_sidecars(storage, sidecars or {})
    if adopt:
        storage.adopt([(f"{name}/{MANIFEST}", local / MANIFEST)])
    else:
        storage.put(f"{name}/{MANIFEST}", local / MANIFEST)
    return written


def put_sidecars(storage: Storage, sidecars: Sidecars) -> bool:
    """Write the objects a checkpoint carries beside its directory, before its manifest: whenever the
    checkpoint is committed, so are they (a trainer killed between the two would otherwise leave steps
    that a checkpoint covers with no metrics). A failed write never fails the checkpoint: it is logged
    and reported (False), and the caller sends the same content with the next checkpoint."""
    try:
        for key, body in sorted(sidecars.items()):
            put_bytes(storage, key, body)
    except LeaseLost:
        raise
    except Exception as e:  # storage trouble: the checkpoint's own writes retry or fail on their own
        log.warning(
            "%s not written (%s: %s); sent again with the next checkpoint",
            ", ".join(sorted(sidecars)),
            type(e).__name__,
            e,
        )
        return False
    return True


def verify_remote(storage: Storage, manifest: Manifest) -> None:
    """Confirm every uploaded file is what the manifest lists: its size and S3's own check on receipt,
    or (elsewhere) its digest read back."""
    name = step_dir(manifest.step)
    for fname, e in sorted(manifest.files.items()):
        wrong = confirm_stored(storage, f"{name}/{fname}", e.size, digest=e.digest, algo=e.algo)
        if wrong is not None:
            raise CheckpointError(f"{storage.uri}/{name}/{fname} does not match its manifest: {wrong}")
