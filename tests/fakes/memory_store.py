"""An in-memory storage backend, `memory://NAME`: a backend added by one module and one registry line.

    register_backend(Backend("memory", "tests.fakes.memory_store", "memory://name"))

Objects live in this process, in a dict per name (opening the same name again sees them), so another
process cannot open it (no `reopener`: checkpoints stay in the writer thread). It keeps the contract of
trainer/storage/base.py: atomic puts, FileNotFoundError for a missing key, a compare-and-swap on one
object, ages by its own clock; an unfinished write is a pending upload that `cleanup_incomplete` drops.
"""

from __future__ import annotations

import hashlib
import os
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from spotrun.trainer.errors import ConfigError, PreconditionFailed
from spotrun.trainer.storage.base import CHUNK, ObjectInfo, Stamped


@dataclass(frozen=True)
class Obj:
    data: bytes
    mtime: float

    @property
    def version(self) -> str:
        return hashlib.sha256(self.data).hexdigest()[:32]  # of the content, as a directory's and S3's


@dataclass
class Bucket:
    objects: dict[str, Obj] = field(default_factory=dict)
    pending: dict[str, float] = field(default_factory=dict)  # unfinished writes: key -> started at
    lock: threading.Lock = field(default_factory=threading.Lock)


_BUCKETS: dict[str, Bucket] = {}
_BUCKETS_LOCK = threading.Lock()


def open_store(uri: str, options: object = None, create: bool = True) -> MemoryStorage:
    """The factory of `memory://NAME`; with `create=False` the name must have been opened before."""
    name = uri.partition("://")[2].strip("/")
    with _BUCKETS_LOCK:
        if name not in _BUCKETS and not create:
            raise ConfigError(f"no in-memory store {uri!r}; check the storage URI")
        bucket = _BUCKETS.setdefault(name, Bucket())
    return MemoryStorage(f"memory://{name}", bucket)


class MemoryStorage:
    """Objects in a dict; every operation holds the bucket's lock, so each is atomic."""

    def __init__(self, uri: str, bucket: Bucket) -> None:
        self.uri, self.bucket = uri, bucket

    def _obj(self, key: str) -> Obj:
        if not key or key.startswith("/"):
            raise ValueError(f"bad storage key {key!r}: must be non-empty and relative")
        with self.bucket.lock:
            obj = self.bucket.objects.get(key)
        if obj is None:
            raise FileNotFoundError(f"{self.uri}/{key}")
        return obj

    def _store(self, key: str, data: bytes) -> str:
        obj = Obj(data, time.time())
        self.bucket.objects[key] = obj
        return obj.version

    def put(self, key: str, src: Path) -> None:
        data = Path(src).read_bytes()
        with self.bucket.lock:
            self._store(key, data)

    def get(self, key: str, dst: Path) -> None:
        data = self._obj(key).data
        dst.parent.mkdir(parents=True, exist_ok=True)
        tmp = dst.with_name(f".{dst.name}.{os.getpid()}.tmp")
        tmp.write_bytes(data)
        tmp.replace(dst)

    def read(self, key: str) -> Iterator[bytes]:
        data = self._obj(key).data  # here, not in the iterator: a missing key fails the call itself
        return iter([data[i : i + CHUNK] for i in range(0, len(data), CHUNK)] or [b""])

    def list(self, prefix: str = "") -> list[ObjectInfo]:
        with self.bucket.lock:
            items = sorted(self.bucket.objects.items())
        return [ObjectInfo(k, len(o.data), o.mtime) for k, o in items if k.startswith(prefix)]

    def delete(self, keys: Sequence[str]) -> None:
        with self.bucket.lock:
            for key in keys:
                self.bucket.objects.pop(key, None)

    def cleanup_incomplete(self, older_than_s: float) -> int:
        cutoff = time.time() - older_than_s
        with self.bucket.lock:
            old = [k for k, started in self.bucket.pending.items() if started <= cutoff]
            for key in old:
                del self.bucket.pending[key]
        return len(old)

    def begin_write(self, key: str) -> None:
        """Leave an unfinished write of `key` behind (a writer killed mid-upload), for the tests."""
        with self.bucket.lock:
            self.bucket.pending[key] = time.time()

    def read_versioned(self, key: str) -> tuple[bytes, str]:
        obj = self._obj(key)
        return obj.data, obj.version

    def read_stamped(self, key: str) -> Stamped:
        obj = self._obj(key)
        return Stamped(obj.data, obj.version, time.time() - obj.mtime)

    def put_if(self, key: str, data: bytes, *, if_version: str | None) -> str:
        with self.bucket.lock:
            current = self.bucket.objects.get(key)
            if (current.version if current is not None else None) != if_version:
                raise PreconditionFailed(f"{self.uri}/{key}: changed since it was read")
            return self._store(key, data)

    def local_path(self, key: str) -> Path | None:
        return None

    def staging(self) -> Path | None:
        return None

    def adopt(self, files: Sequence[tuple[str, Path]]) -> None:
        raise NotImplementedError("an in-memory store has no staging directory")

    def checked_size(self, key: str) -> int | None:
        self._obj(key)
        return None  # nothing vouches for what was stored: confirm_stored reads it back
