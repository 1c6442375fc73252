"""The chaos campaign's invariants, checked from outside the processes under test.

Pure functions (`interleaved_writers`, `history_gaps`, `bad_adoptions`) are driven by tables in the
suite; the rest read storage and /proc. Every check uses its own storage client straight to moto, never
the fault proxy. `Tally` counts the faults and the violations.
"""

from __future__ import annotations

import collections
import json
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from spotrun.trainer.checkpoint.catalog import Catalog
from spotrun.trainer.storage import Storage


@dataclass
class Tally:
    """The campaign's counts: faults injected by kind, and each invariant's violations."""

    faults: collections.Counter[str] = field(default_factory=collections.Counter)
    bad_resumes: int = 0
    unreadable_latest: int = 0
    lost_history_rows: int = 0
    leaked_processes: int = 0
    duplicate_writers: int = 0
    bad_adoptions: int = 0
    lost_steps: list[int] = field(default_factory=list)
    attempts: int = 0
    episodes: int = 0
    problems: list[str] = field(default_factory=list)

    def bad(self, what: str) -> None:
        self.problems.append(what)
        print(f"  VIOLATION {what}", flush=True)

    def summary(self) -> dict[str, Any]:
        mean = sum(self.lost_steps) / len(self.lost_steps) if self.lost_steps else 0.0
        return {
            "faults": sum(self.faults.values()),
            "bad_resumes": self.bad_resumes,
            "unreadable_latest": self.unreadable_latest,
            "lost_history_rows": self.lost_history_rows,
            "leaked_processes": self.leaked_processes,
            "duplicate_writers": self.duplicate_writers,
            "bad_adoptions": self.bad_adoptions,
            "mean_lost_steps": round(mean, 2),
        }


def interleaved_writers(pids: Iterable[int]) -> int:
    """How many writers wrote to one storage again after another writer had written to it.

    Writers of one storage must follow one another (a killed one never writes again; a stopped one
    released the lease before the next acquired it), so the log reads as runs of one pid each:
    A A B B C is fine, A B A is one writer too many."""
    seen: set[int] = set()
    bad: set[int] = set()
    last: int | None = None
    for pid in pids:
        if pid != last and pid in seen:
            bad.add(pid)
        seen.add(pid)
        last = pid
    return len(bad)


def publog(path: Path) -> list[dict[str, Any]]:
    """Every logged put/delete ({"pid", "op", "key"}), in the order they were sent."""
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def writer_runs(writes: Sequence[dict[str, Any]]) -> list[str]:
    """The write log as runs of one writer each: who wrote what, in order (for a violation's report)."""
    runs: list[list[dict[str, Any]]] = []
    for w in writes:
        if runs and runs[-1][0]["pid"] == w["pid"]:
            runs[-1].append(w)
        else:
            runs.append([w])
    return [
        f"pid {r[0]['pid']}: {len(r)} writes, {r[0]['op']} {r[0]['key']} .. {r[-1]['op']} {r[-1]['key']}"
        for r in runs
    ]


def history_gaps(written: Iterable[int], present: Iterable[int]) -> int:
    """Rows written (or journaled) but missing after replay, plus rows present more than once."""
    counts = collections.Counter(present)
    missing = sum(1 for a in set(written) if counts[a] == 0)
    return missing + sum(n - 1 for n in counts.values() if n > 1)


def bad_adoptions(kills: Sequence[str], runs: Sequence[tuple[str, int]], lost: Sequence[str]) -> int:
    """How far the SQL history of a job whose controllers were SIGKILLed is from what the kills imply.

    `kills`: for each controller killed once its job run existed, the worker its `worker.json` named
    ("" when none); `runs`: (status, controller_restarts) of every job run of the job; `lost`: the
    worker of each attempt recorded lost because its controller died, in attempt order. Expected: one
    job run, completed, restarted once per kill, and one lost row per attempt that was in flight
    (`expected_lost`)."""
    bad = abs(len(runs) - 1)
    if runs:
        status, restarts = runs[-1]
        bad += int(status != "completed") + abs(restarts - len(kills))
    want = expected_lost(kills)
    return bad + abs(len(lost) - len(want)) + sum(k != w for k, w in zip(want, lost, strict=False))


def expected_lost(kills: Sequence[str]) -> list[str]:
    """The lost rows the kills imply: one per kill that left a worker in flight. A kill between
    attempts leaves none; a worker named again by the next kill is the same dead attempt (that
    controller died before it had a worker of its own)."""
    out: list[str] = []
    for k in kills:
        if k and (not out or out[-1] != k):
            out.append(k)
    return out


def newest_verified(storage: Storage, cache: Path) -> int | None:
    """The newest committed checkpoint whose files all match its manifest: what a resume must pick."""
    return Catalog(storage, cache).select(None, integrity_only=True).step


def latest_unreadable(storage: Storage, cache: Path) -> str | None:
    """Why `latest` names no checkpoint that verifies; None when it does (or names nothing yet)."""
    catalog = Catalog(storage, cache)
    step = catalog.latest()
    if step is None:
        return None
    _, problems = catalog.validate(step, None, integrity_only=True)
    return f"latest -> step {step}: {problems[0]}" if problems else None


def processes_with(mark: str) -> list[int]:
    """Pids (not this one) whose command line contains `mark`: the campaign's trainers and their
    data-loader workers all carry the campaign directory in theirs."""
    found = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit() or int(d.name) == os.getpid():
            continue
        try:
            cmdline = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = (d / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if mark in cmdline and state != "Z":
            found.append(int(d.name))
    return found
