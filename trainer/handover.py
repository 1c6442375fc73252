"""Train through the notice: the old worker keeps training until its replacement stands by.

A replacement started at the notice (tasks/prewarm.py) needs a cold start before it can train:
the interpreter, `import torch`, the recipe and its data (2-6 s on a 2-core VM, an instance boot on
EC2). The old worker, once noticed, needs only one emergency checkpoint (0.02-0.5 s here). Stopping
at once leaves the job idle for the whole cold start; so a trainer started with `--handover-s`
keeps training after a notice until the replacement writes that it waits for the lease, then takes
its emergency checkpoint and exits, and the replacement resumes from that checkpoint a poll later.

Three objects in the job's storage, one writer each:

    _standby.json   {"replacing": WORKER, "state": "starting" | "waiting", "worker": ID, "at": t}
                    "starting": the controller's word, written when it starts the replacement;
                    "waiting": the replacement's, once its recipe is built and it polls the lease.

The old trainer stops training (and saves) at the first of:
- a `waiting` standby that replaces it: the replacement is ready;
- no standby naming it within ANNOUNCE_S of the notice: nobody is coming (the controller is
  cancelling, or is gone), so waiting would only delay the stop;
- `handover_s` after the notice, or earlier where the notice's deadline leaves only the time the
  emergency checkpoint needs (its estimate plus `save_margin_s`).

SIGINT (Ctrl-C) always stops at once, as does any stop of a job with several ranks (their stop is
agreed by all-reduce every step; a handover there is not built).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from trainer.storage import Storage, get_bytes, put_bytes

log = logging.getLogger(__name__)

STANDBY_KEY = "_standby.json"
ANNOUNCE_S = 1.5  # the controller announces 0.05-0.3 s after the notice record (measured), more under load
POLL_S = 0.1


@dataclass(frozen=True)
class Standby:
    replacing: str  # the worker it replaces
    state: str  # starting | waiting
    worker: str  # the replacement ("" while the controller is still provisioning it)
    at: float


def write_standby(storage: Storage, replacing: str, state: str, worker: str = "") -> None:
    """Announce (the controller: `starting`) or report ready (the replacement: `waiting`)."""
    body = {"replacing": replacing, "state": state, "worker": worker, "at": time.time()}
    put_bytes(storage, STANDBY_KEY, json.dumps(body).encode())


def read_standby(storage: Storage) -> Standby | None:
    """The standby record, or None when absent or unreadable (a handover then just ends sooner)."""
    try:
        d = json.loads(get_bytes(storage, STANDBY_KEY))
        return Standby(str(d["replacing"]), str(d["state"]), str(d.get("worker", "")), float(d["at"]))
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as e:  # a poll that fails ends the wait early
        log.warning("handover: cannot read %s/%s: %s", storage.uri, STANDBY_KEY, e)
        return None


def stop_now(standby: Standby | None, me: str, since_notice_s: float, left_s: float) -> str | None:
    """Why the old trainer stops training now, or None to train on (pure; table-tested).
    `since_notice_s`: seconds since the notice; `left_s`: seconds of training the handover still has."""
    mine = standby is not None and standby.replacing == me
    if mine and standby is not None and standby.state == "waiting":
        return f"replacement {standby.worker or '?'} stands by"
    if left_s <= 0:
        return "no time left for more training before the emergency checkpoint"
    if not mine and since_notice_s >= ANNOUNCE_S:
        return f"no replacement announced within {ANNOUNCE_S:g} s"
    return None


class Handover:
    """Polls the standby record in a thread from the notice on; `reason` is set once training should
    stop. `budget_s`: how long training may go on (the caller bounds it by the notice's deadline)."""

    def __init__(
        self,
        storage: Storage,
        me: str,
        budget_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._storage, self._me, self._clock = storage, me, clock
        self._t0 = clock()
        self._end = self._t0 + max(0.0, budget_s)
        self._done = threading.Event()
        self.reason: str | None = None
        self._thread = threading.Thread(target=self._poll, name="spotrun-handover", daemon=True)
        self._thread.start()

    @property
    def ready(self) -> bool:
        return self._done.is_set()

    @property
    def waited_s(self) -> float:
        return self._clock() - self._t0

    def _poll(self) -> None:
        while not self._done.is_set():
            now = self._clock()
            why = stop_now(read_standby(self._storage), self._me, now - self._t0, self._end - now)
            if why is not None:
                self.reason = why
                self._done.set()
                return
            time.sleep(POLL_S)
