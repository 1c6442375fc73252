"""A storage that counts the calls made to the one it wraps, `counting://PATH` a directory's: what a
directory store's cost is measured in (S3's is counted in requests at the moto server).

    register_backend(Backend("counting", "tests.fakes.counting_store", "counting:///dir", local=True))

Every store opened on one path shares one `Calls`, so a test sees the calls of stores that code under
test opened itself (the tracker opens the job's).
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from spotrun.trainer.storage.base import ObjectInfo, Stamped
from spotrun.trainer.storage.local import LocalStorage


@dataclass
class Calls:
    by_method: Counter[str] = field(default_factory=Counter)
    listed: list[str] = field(default_factory=list)  # the prefix of each `list`
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, method: str, prefix: str | None = None) -> None:
        with self.lock:
            self.by_method[method] += 1
            if prefix is not None:
                self.listed.append(prefix)

    def total(self) -> int:
        return sum(self.by_method.values())

    def reset(self) -> None:
        with self.lock:
            self.by_method.clear()
            self.listed.clear()


CALLS: dict[Path, Calls] = {}


def calls_at(root: str | Path) -> Calls:
    """The counter of every store opened on `root`."""
    return CALLS.setdefault(Path(root).resolve(), Calls())


def open_store(uri: str, options: object = None, create: bool = True) -> CountingStorage:
    """The factory of `counting://PATH`."""
    return CountingStorage(LocalStorage(uri.partition("://")[2]))


class CountingStorage:
    """Counts each call, then passes it on to `inner`."""

    def __init__(self, inner: LocalStorage) -> None:
        self.inner, self.uri = inner, inner.uri
        self.calls = calls_at(inner.root)

    def _count(self, method: str, prefix: str | None = None) -> None:
        self.calls.add(method, prefix)

    def put(self, key: str, src: Path) -> None:
        self._count("put")
        self.inner.put(key, src)

    def get(self, key: str, dst: Path) -> None:
        self._count("get")
        self.inner.get(key, dst)

    def read(self, key: str) -> Iterator[bytes]:
        self._count("read")
        return self.inner.read(key)

    def list(self, prefix: str = "") -> list[ObjectInfo]:
        self._count("list", prefix)
        return self.inner.list(prefix)

    def delete(self, keys: Sequence[str]) -> None:
        self._count("delete")
        self.inner.delete(keys)

    def cleanup_incomplete(self, older_than_s: float) -> int:
        self._count("cleanup_incomplete")
        return self.inner.cleanup_incomplete(older_than_s)

    def read_versioned(self, key: str) -> tuple[bytes, str]:
        self._count("read_versioned")
        return self.inner.read_versioned(key)

    def read_stamped(self, key: str) -> Stamped:
        self._count("read_stamped")
        return self.inner.read_stamped(key)

    def put_if(self, key: str, data: bytes, *, if_version: str | None) -> str:
        self._count("put_if")
        return self.inner.put_if(key, data, if_version=if_version)

    def local_path(self, key: str) -> Path | None:
        return self.inner.local_path(key)

    def staging(self) -> Path | None:
        return self.inner.staging()

    def adopt(self, files: Sequence[tuple[str, Path]]) -> None:
        self._count("adopt")
        self.inner.adopt(files)

    def checked_size(self, key: str) -> int | None:
        self._count("checked_size")
        return self.inner.checked_size(key)

    def reopener(self) -> Callable[[], Any] | None:
        return None
