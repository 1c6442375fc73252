"""A heartbeat object in the job's storage, for supervisors that cannot read the trainer's stdout
(a provider whose trainer runs on another machine, such as EC2).

The contract (providers read exactly this; change it only with them):

  key      `_workers/<worker_id>/heartbeat.json`, relative to the job's storage root
           (`heartbeat_key`). Checkpoint listing ignores it: `_workers` is no step directory.
  content  {"worker_id": str,
            "t": float,                  epoch seconds of this write
            "pid": int,
            "last_step": int | null,     newest step any status record named
            "durable_step": int | null,  newest step known durable
            "losses": [[step, loss], ...]  every `step` record's loss since the newest durable step,
                                         oldest first (at most MAX_LOSSES): what a reclaim would lose,
                                         for the resume-fidelity check (tasks/tracking/fidelity.py)
            "records": {kind: record}}   the last status record of each kind, exactly the JSON of
                                         its `@spotrun` line (trainer/telemetry/status.py), e.g.
                                         records["exit"] = {"kind": "exit", "t": ..., "code": 75,
                                                            "name": "PREEMPTED", ...}
  when     once at start (records empty); at once on every `started`, `notice`, `durable` and
           `stopping` record; otherwise at most every 5 s while records arrive (`step` records come
           while training runs); the `exit` record synchronously, before the process exits. A hung
           trainer writes nothing: a stale `t` means what silence on stdout means to the local
           provider.

Writes run in a background thread (the exit write in the caller's), the newest state wins, and a
failing write is logged (at most once a minute) and never stops training.
"""

from __future__ import annotations

import json
import logging
import os
import re
import threading
import time
from collections.abc import Callable
from typing import Any

from spotrun.trainer.errors import ConfigError
from spotrun.trainer.storage import Storage, get_bytes, put_bytes
from spotrun.trainer.telemetry.records import KINDS, Durable, Record, Step, parse_record

log = logging.getLogger(__name__)

WORKERS_DIR = "_workers"
HEARTBEAT_EVERY_S = 5.0
MAX_LOSSES = 2000  # step records come at most 4 a second: over 8 minutes between two checkpoints
PROMPT_KINDS = frozenset({"started", "notice", "durable", "stopping"})
ERROR_LOG_EVERY_S = 60.0
_WORKER_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")


def heartbeat_key(worker_id: str) -> str:
    """`_workers/<worker_id>/heartbeat.json`; ConfigError for an id that is not a plain name."""
    if not _WORKER_ID.match(worker_id):
        raise ConfigError(
            f"worker id {worker_id!r}: use letters, digits, '.', '_' and '-' (at most 128, no '/')"
        )
    return f"{WORKERS_DIR}/{worker_id}/heartbeat.json"


def read_heartbeat(storage: Storage, worker_id: str) -> dict[str, Any] | None:
    """The worker's last heartbeat, or None when there is none (yet) or it does not parse."""
    try:
        doc = json.loads(get_bytes(storage, heartbeat_key(worker_id)))
    except FileNotFoundError:
        return None
    except ValueError:
        log.warning("ignoring a malformed heartbeat of worker %s in %s", worker_id, storage.uri)
        return None
    return doc if isinstance(doc, dict) else None


def heartbeat_losses(doc: dict[str, Any]) -> dict[int, float]:
    """step -> loss of the step records a heartbeat carries (those after its durable step)."""
    out: dict[int, float] = {}
    raw = doc.get("losses")
    for item in raw if isinstance(raw, list) else []:
        try:
            step, loss = item
            out[int(step)] = float(loss)
        except (TypeError, ValueError):
            continue
    return out


def heartbeat_records(doc: dict[str, Any]) -> list[Record]:
    """The records of a heartbeat, oldest first (by `t`, then in the order a trainer writes the kinds);
    unknown and malformed ones left out."""
    raw = doc.get("records")
    found = [r for v in raw.values() if (r := parse_record(v)) is not None] if isinstance(raw, dict) else []
    order = list(KINDS)
    return sorted(found, key=lambda r: (r.t, order.index(r.kind)))


class HeartbeatWriter:
    """A StatusReporter listener (`reporter.subscribe(writer)`) that mirrors records into storage."""

    def __init__(
        self,
        storage: Storage,
        worker_id: str,
        every_s: float = HEARTBEAT_EVERY_S,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.storage, self.worker_id, self.key = storage, worker_id, heartbeat_key(worker_id)
        self.every_s, self.clock, self.pid = every_s, clock, os.getpid()
        self.records: dict[str, dict[str, Any]] = {}
        self.last_step: int | None = None
        self.durable_step: int | None = None
        self.losses: list[tuple[int, float]] = []  # (step, loss) of step records after durable_step
        self.writes = self.failures = 0
        self._state = threading.Condition()  # guards records, steps, _seq, _closed
        self._write_lock = threading.Lock()  # one put at a time; guards _written
        self._seq = self._written = 0  # state version wanted vs stored
        self._last_scheduled = -every_s
        self._last_error_log = -ERROR_LOG_EVERY_S
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="spotrun-heartbeat", daemon=True)

    def start(self) -> HeartbeatWriter:
        with self._state:
            self._schedule()
        self._thread.start()
        return self

    def __call__(self, rec: Record) -> None:
        kind = rec.kind
        with self._state:
            self.records[kind] = rec.to_json()
            step, durable = getattr(rec, "step", None), getattr(rec, "durable_step", None)
            if isinstance(step, int):
                self.last_step = step
                if isinstance(rec, Durable):
                    self.durable_step = step
            if isinstance(durable, int):
                self.durable_step = durable
            if isinstance(rec, Step) and rec.loss is not None:
                self.losses.append((rec.step, rec.loss))
            if self.durable_step is not None and self.losses and self.losses[0][0] <= self.durable_step:
                self.losses = [x for x in self.losses if x[0] > self.durable_step]
            del self.losses[:-MAX_LOSSES]
            due = time.monotonic() - self._last_scheduled >= self.every_s
            if kind in PROMPT_KINDS or kind == "exit" or due:
                self._schedule()
        if kind == "exit":
            self.flush()

    def flush(self) -> None:
        """Write the current state now, in the calling thread."""
        self._write(*self._payload())

    def close(self) -> None:
        with self._state:
            self._closed = True
            self._state.notify()

    def _schedule(self) -> None:
        self._seq += 1
        self._last_scheduled = time.monotonic()
        self._state.notify()

    def _payload(self) -> tuple[int, dict[str, Any]]:
        with self._state:
            body = {
                "worker_id": self.worker_id,
                "t": self.clock(),
                "pid": self.pid,
                "last_step": self.last_step,
                "durable_step": self.durable_step,
                "losses": [list(x) for x in self.losses],
                "records": dict(self.records),
            }
            return self._seq, body

    def _run(self) -> None:
        while True:
            with self._state:
                while self._seq <= self._written and not self._closed:
                    self._state.wait()
                if self._closed:
                    return
            self._write(*self._payload())

    def _write(self, seq: int, body: dict[str, Any]) -> None:
        with self._write_lock:
            if seq <= self._written:
                return  # a newer state is stored already
            try:
                put_bytes(self.storage, self.key, json.dumps(body, separators=(",", ":")).encode())
            except Exception as e:  # boundary: a heartbeat must never stop training; logged, next one retries
                self._failed(e)
            else:
                self.writes += 1
            self._written = seq  # also on failure: retry with the next record, not in a tight loop

    def _failed(self, e: Exception) -> None:
        self.failures += 1
        now = time.monotonic()
        if now - self._last_error_log >= ERROR_LOG_EVERY_S:
            self._last_error_log = now
            log.warning(
                "heartbeat write to %s/%s failed (%d so far): %s: %s",
                self.storage.uri,
                self.key,
                self.failures,
                type(e).__name__,
                e,
            )
