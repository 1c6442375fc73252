"""The storage seam: a small protocol with a local-directory and an S3 backend.

Keys are '/'-separated paths relative to the backend's root. `put` is atomic per object on
both backends: a reader sees the old object, the whole new one, or nothing. A checkpoint as a
whole becomes visible only when its manifest (written last) exists; that is the format's rule,
not the backend's.
"""

from __future__ import annotations

import hashlib
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, runtime_checkable

CHUNK = 1 << 20


@dataclass(frozen=True)
class ObjectInfo:
    key: str
    size: int
    mtime: float  # seconds since the epoch


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


def put_bytes(storage: Storage, key: str, data: bytes) -> None:
    """Store a small object from memory."""
    with tempfile.TemporaryDirectory(prefix="spotrun-put-") as d:
        p = Path(d) / "obj"
        p.write_bytes(data)
        storage.put(key, p)


def get_bytes(storage: Storage, key: str) -> bytes:
    """Fetch a small object into memory."""
    return b"".join(storage.read(key))


def sha256_of(storage: Storage, key: str) -> tuple[str, int]:
    """Read an object back and return (sha256 hex, size)."""
    h = hashlib.sha256()
    n = 0
    for chunk in storage.read(key):
        h.update(chunk)
        n += len(chunk)
    return h.hexdigest(), n
