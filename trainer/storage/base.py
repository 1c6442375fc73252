"""The storage seam: a small protocol with a local-directory and an S3 backend.

Keys are '/'-separated paths relative to the backend's root. `put` is atomic per object on
both backends: a reader sees the old object, the whole new one, or nothing. A checkpoint as a
whole becomes visible only when its manifest (written last) exists; that is the format's rule,
not the backend's.

`read_versioned` and `put_if` are a compare-and-swap on one small object (the storage lease,
trainer/preemption/lease.py): a version is an opaque string (S3's ETag, a content hash locally) and a put
whose precondition no longer holds raises `PreconditionFailed` and changes nothing. `read_stamped`
adds the object's age by the store's own clock, so that a machine judging another's lease never
compares two machines' clocks.

Optional capabilities beyond the core: `Reopenable` (another process can open the same store again:
the checkpoint writer process's storage).
"""

from __future__ import annotations

import hashlib
import tempfile
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, runtime_checkable

from spotrun.trainer.storage.digests import DIGEST, digest_chunks
from spotrun.trainer.storage.registry import backend_for

CHUNK = 1 << 20


@dataclass(frozen=True)
class ObjectInfo:
    key: str
    size: int
    mtime: float  # seconds since the epoch


@dataclass(frozen=True)
class Stamped:
    """A small object with its version and its age, read in one request."""

    data: bytes
    version: str
    age_s: float  # the store's now minus the store's time of the last write (S3: whole seconds)


@runtime_checkable
class Storage(Protocol):
    """Object storage for checkpoints. Only `TransientStorageError` is worth retrying."""

    uri: str

    def put(self, key: str, src: Path) -> None:
        """Store the file `src` under `key`, atomically."""
        ...

    def get(self, key: str, dst: Path) -> None:
        """Download `key` to `dst` (via a temp file and rename). FileNotFoundError if absent."""
        ...

    def read(self, key: str) -> Iterator[bytes]:
        """Stream the object's bytes. FileNotFoundError if absent."""
        ...

    def list(self, prefix: str = "") -> list[ObjectInfo]:
        """Every object whose key starts with `prefix`, sorted by key."""
        ...

    def delete(self, keys: Sequence[str]) -> None:
        """Delete the keys; missing keys are not an error."""
        ...

    def cleanup_incomplete(self, older_than_s: float) -> int:
        """Remove partial writes older than the age (temp files, multipart uploads); return how many."""
        ...

    def read_versioned(self, key: str) -> tuple[bytes, str]:
        """A small object's bytes and its version. FileNotFoundError if absent."""
        ...

    def read_stamped(self, key: str) -> Stamped:
        """`read_versioned` plus the object's age by the store's clock: S3's `Date` minus its
        `Last-Modified`; a directory's file: a freshly touched file's mtime minus its own (on a
        network volume both come from the server). FileNotFoundError if absent."""
        ...

    def put_if(self, key: str, data: bytes, *, if_version: str | None) -> str:
        """Store `data` only if `key` is at `if_version` (None: only if absent); return the new version.

        PreconditionFailed, with nothing written, when the condition does not hold."""
        ...

    def local_path(self, key: str) -> Path | None:
        """Where `key` is on this machine's file system when the store is a directory (readers then
        read it in place), None for an object store. Never for writing: writes go through the store."""
        ...

    def staging(self) -> Path | None:
        """A new, empty directory on the store's own file system for one writer's files, which are
        then taken in with `adopt` without a second copy of their bytes (a local or network directory);
        None for an object store, where files are written locally and uploaded with `put`. The caller
        removes it when done; `cleanup_incomplete` removes one a killed writer left behind."""
        ...

    def adopt(self, files: Sequence[tuple[str, Path]]) -> None:
        """Store each `(key, src)`, `src` a whole, fsynced file under `staging()`, as `key` by renaming
        it (atomically; `src` is gone), all of them durable on return. Only for storages whose
        `staging()` is not None."""
        ...

    def checked_size(self, key: str) -> int | None:
        """The stored object's size, if the backend verified its bytes on receipt against a checksum
        the client computed from the source file (S3 with flexible checksums); None when it cannot
        say, and the caller reads the object back to confirm it. FileNotFoundError if absent."""
        ...


@runtime_checkable
class Reopenable(Protocol):
    """A store that another process can open again (the checkpoint writer process opens its own)."""

    def reopener(self) -> Callable[[], Storage] | None:
        """A picklable callable that opens this same store in another process; None when another
        process could not (a test double whose behaviour a plain reopen would lose)."""
        ...


def normalize_uri(uri: str) -> str:
    """One spelling per storage location: an object store's URI (`s3://bucket/prefix`) without a trailing
    '/', or an absolute local path (relative paths resolve against the current directory)."""
    backend = backend_for(uri)
    if backend is not None and not backend.local:
        return uri.rstrip("/")
    return str(Path(uri.removeprefix("file://")).expanduser().resolve())


def local_dir_name(job_name: str, uri: str) -> str:
    """`<job>-<8 hex>`: the name of a job's local directories (checkpoint cache, worker files), keyed by
    its storage as well, so two jobs sharing a `name:` with different storage never share a cache."""
    digest = hashlib.sha256(normalize_uri(uri).encode()).hexdigest()[:8]
    return f"{job_name}-{digest}"


def put_bytes(storage: Storage, key: str, data: bytes) -> None:
    """Store a small object from memory."""
    with tempfile.TemporaryDirectory(prefix="spotrun-put-") as d:
        p = Path(d) / "obj"
        p.write_bytes(data)
        storage.put(key, p)


# What a marker or record (`latest`, `_standby.json`, a heartbeat, a manifest, a step's metrics) may weigh:
# spotrun's own are bytes to a few MB; a bucket writer's 30 GB `_standby.json` must not OOM the readers.
SMALL_OBJECT_MAX = 64 * 2**20


class ObjectTooLarge(ValueError):
    """A small object (a marker, a record) over SMALL_OBJECT_MAX: not one spotrun wrote; readers that
    take a malformed marker as absent take this one so too."""


def get_bytes(storage: Storage, key: str) -> bytes:
    """Fetch a small object into memory, reading no more than SMALL_OBJECT_MAX (ObjectTooLarge)."""
    limit, size, chunks = SMALL_OBJECT_MAX, 0, []
    for chunk in storage.read(key):
        size += len(chunk)
        if size > limit:
            raise ObjectTooLarge(
                f"{key} in {storage.uri} is over {limit:,} bytes: no marker or record of spotrun's"
            )
        chunks.append(chunk)
    return b"".join(chunks)


def digest_of(storage: Storage, key: str, algo: str = DIGEST) -> tuple[str, int]:
    """Read an object back and return (hex digest, size)."""
    return digest_chunks(storage.read(key), algo)


def sha256_of(storage: Storage, key: str) -> tuple[str, int]:
    return digest_of(storage, key, "sha256")


def confirm_stored(storage: Storage, key: str, size: int, *, digest: str, algo: str = DIGEST) -> str | None:
    """None when `key` holds the bytes we wrote (size, and the digest or the backend's own check on
    receipt), else what is wrong. S3 verified every byte against the client's checksum as it arrived:
    a HEAD (size and checksum present) replaces downloading the object again; elsewhere it is read."""
    checked = storage.checked_size(key)
    if checked is not None:
        return None if checked == size else f"stored size {checked} != {size}"
    got, n = digest_of(storage, key, algo)
    if n != size:
        return f"stored size {n} != {size}"
    return None if got == digest else f"stored {algo} differs"
