"""Where history writes wait while the database is down: a JSON-lines file per database, or memory.

The file journal survives the process: every append is flushed and fsync'd before the write returns,
and the next spotrun process that opens the same database (flow, CLI, alerts) replays it. Processes
share it under an exclusive `flock` on a sidecar `.lock` file (never replaced, so compaction may
swap the journal itself). A process killed mid-append leaves a partial last line: the next append
starts on a new line, and reading skips it with a warning.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Protocol

from spotrun.tasks.history.ops import Op
from spotrun.trainer.storage.locks import flock_within

LOCK_WAIT_S = 60.0  # an append is a write and an fsync: a minute is a hung holder, not a slow one

log = logging.getLogger(__name__)


class Journal(Protocol):
    """The writes that wait for the database, oldest first."""

    @property
    def where(self) -> str: ...  # for messages: a path, or "memory"

    def __len__(self) -> int: ...

    def append(self, op: Op) -> None: ...

    def replay(self, apply: Callable[[Op], bool]) -> bool:
        """Apply the writes in order until `apply` says stop (False); keep the rest. True: now empty."""
        ...


def journal_path(directory: Path, url: str) -> Path:
    """The journal of the database at `url` (its rendered URL, password hidden) in `directory`."""
    return directory / f"{hashlib.sha256(url.encode()).hexdigest()[:16]}.jsonl"


class MemoryJournal:
    """Writes wait in this process only: lost if it ends before the database returns."""

    where = "memory"

    def __init__(self) -> None:
        self._ops: list[Op] = []

    def __len__(self) -> int:
        return len(self._ops)

    def append(self, op: Op) -> None:
        self._ops.append(op)

    def replay(self, apply: Callable[[Op], bool]) -> bool:
        while self._ops:
            if not apply(self._ops[0]):
                return False
            self._ops.pop(0)
        return True


class FileJournal:
    """Writes wait in `path` (JSON lines), durable and shared by every process using that database."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._lock_path = path.with_name(path.name + ".lock")

    @property
    def where(self) -> str:
        return str(self.path)

    def __len__(self) -> int:
        if not self._nonempty():
            return 0
        with self._locked():
            return len(self._read()[0])

    def append(self, op: Op) -> None:
        line = (op.to_json() + "\n").encode()
        with self._locked(), open(self.path, "ab") as f:
            if f.tell() > 0 and not _ends_with_newline(self.path):
                line = b"\n" + line  # the last append was cut short: leave its bytes on their own line
            f.write(line)
            f.flush()
            os.fsync(f.fileno())

    def replay(self, apply: Callable[[Op], bool]) -> bool:
        if not self._nonempty():  # the common case, one stat: nothing waits
            return True
        with self._locked():
            ops, skipped = self._read()
            for done, op in enumerate(ops):
                if not apply(op):
                    if done or skipped:
                        self._rewrite(ops[done:])
                    return False
            self._rewrite([])
            return True

    def _nonempty(self) -> bool:
        try:
            return self.path.stat().st_size > 0
        except FileNotFoundError:
            return False

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        """The journal's lock, released by close (also when the process dies); a holder that hangs (a
        stopped process) makes this raise LockTimeout after LOCK_WAIT_S instead of waiting forever."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with flock_within(self._lock_path, LOCK_WAIT_S, "history journal"):
            yield

    def _read(self) -> tuple[list[Op], int]:
        """The operations in order, and how many lines were skipped (cut short, or not ours)."""
        try:
            data = self.path.read_bytes()
        except FileNotFoundError:
            return [], 0
        ops, skipped = [], 0
        for n, raw in enumerate(data.splitlines(), start=1):
            if not raw.strip():
                continue
            try:
                ops.append(Op.from_json(raw.decode()))
            except ValueError as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
                skipped += 1
                log.warning("history journal %s: skipped line %d, not a whole record (%s)", self.path, n, e)
        return ops, skipped

    def _rewrite(self, ops: list[Op]) -> None:
        """Replace the journal with `ops` (none: truncate), durably: temp file, fsync, rename."""
        tmp = self.path.with_name(self.path.name + ".tmp")
        with open(tmp, "wb") as f:
            f.write(b"".join((op.to_json() + "\n").encode() for op in ops))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)
        dfd = os.open(self.path.parent, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)


def _ends_with_newline(path: Path) -> bool:
    with open(path, "rb") as f:
        f.seek(-1, os.SEEK_END)
        return f.read(1) == b"\n"
