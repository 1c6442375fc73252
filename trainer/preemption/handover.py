"""Train through the notice: the old worker keeps training until its replacement stands by.

A replacement started at the notice (tasks/control/prewarm.py) needs a cold start before it can train:
the interpreter, `import torch`, the recipe and its data (2-6 s on a 2-core VM, an instance boot on
EC2). The old worker, once noticed, needs only one emergency checkpoint (0.02-0.5 s here). Stopping
at once leaves the job idle for the whole cold start; so a trainer started with `--handover-s`
keeps training after a notice until the replacement writes that it waits for the lease, then takes
its emergency checkpoint and exits, and the replacement resumes from that checkpoint a poll later.

One object in the job's storage, with two writers in turn:

    _standby.json   {"replacing": WORKER, "state": "starting" | "waiting", "worker": ID, "at": t
                     [, "peer": {"addr": HOST:PORT, "token": T}]}
                    "starting": the controller's word, written when it starts the replacement;
                    "waiting": the replacement's, once its recipe is built and it polls the lease.

The old trainer stops training (and saves) at the first of:
- a `waiting` standby that replaces it: the replacement is ready;
- no standby naming it within the announcement window (ANNOUNCE_S locally; EC2's provider passes
  its poll interval plus a heartbeat's, `--announce-s`) of the notice: nobody is coming (the
  controller is cancelling, or is gone), so waiting would only delay the stop;
- a second stop request (a cancel's SIGTERM, the instance shutting down, Ctrl-C);
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
from typing import Any

from spotrun.trainer.checkpoint.signing import marker_problem, sign_marker
from spotrun.trainer.errors import StorageError
from spotrun.trainer.storage import Storage, get_bytes, put_bytes

log = logging.getLogger(__name__)

STANDBY_KEY = "_standby.json"
ANNOUNCE_S = 1.5  # the controller announces 0.05-0.3 s after the notice record (measured), more under load
POLL_S = 0.1


@dataclass(frozen=True)
class Advert:
    """Where a standby takes copies: its address and the token a sender must present."""

    addr: str  # "host:port"
    token: str

    def as_dict(self) -> dict[str, str]:
        return {"addr": self.addr, "token": self.token}

    @classmethod
    def from_dict(cls, d: Any) -> Advert | None:
        if (
            not isinstance(d, dict)
            or not isinstance(d.get("addr"), str)
            or not isinstance(d.get("token"), str)
        ):
            return None
        return cls(d["addr"], d["token"])


@dataclass(frozen=True)
class Standby:
    replacing: str  # the worker it replaces
    state: str  # starting | waiting
    worker: str  # the replacement ("" while the controller is still provisioning it)
    at: float
    peer: Advert | None = None  # where a waiting standby takes copies of the state (trainer/saving/peer.py)


def write_standby(
    storage: Storage, replacing: str, state: str, worker: str = "", *, peer: Advert | None = None
) -> None:
    """Announce (the controller: `starting`) or report ready (the replacement: `waiting`, with where it
    takes copies of the state when it does)."""
    doc: dict[str, Any] = {"replacing": replacing, "state": state, "worker": worker, "at": time.time()}
    if peer is not None:
        doc["peer"] = peer.as_dict()
    body = sign_marker(doc)
    put_bytes(storage, STANDBY_KEY, json.dumps(body).encode())


def read_standby(storage: Storage) -> Standby | None:
    """The standby record, or None when absent or unreadable (the next poll reads it again)."""
    try:
        d = json.loads(get_bytes(storage, STANDBY_KEY))
        standby = Standby(
            replacing=str(d["replacing"]),
            state=str(d["state"]),
            worker=str(d.get("worker", "")),
            at=float(d["at"]),
            peer=Advert.from_dict(d.get("peer")),
        )
        if (problem := marker_problem(d)) is not None:  # with a key, a forged one hands nothing over
            log.warning("handover: ignoring %s/%s: %s", storage.uri, STANDBY_KEY, problem)
            return None
        return standby
    except FileNotFoundError:
        return None
    except (OSError, StorageError, ValueError, KeyError, TypeError) as e:  # polled again next time
        log.warning("handover: cannot read %s/%s: %s", storage.uri, STANDBY_KEY, e)
        return None


def stop_now(
    standby: Standby | None, me: str, since_notice_s: float, *, left_s: float, announce_s: float = ANNOUNCE_S
) -> str | None:
    """Why the old trainer stops training now, or None to train on (pure; table-tested).
    `since_notice_s`: seconds since the notice; `left_s`: seconds of training the handover still has."""
    mine = standby is not None and standby.replacing == me
    if mine and standby is not None and standby.state == "waiting":
        return f"replacement {standby.worker or '?'} stands by"
    if left_s <= 0:
        return NO_TIME_LEFT
    if not mine and since_notice_s >= announce_s:
        return f"no replacement announced within {announce_s:g} s"
    return None


NO_TIME_LEFT = "no time left for more training before the emergency checkpoint"


class Handover:
    """Polls the standby record in a thread from the notice on; `reason` is set once training should
    stop. `budget_s`: how long training may go on (the caller bounds it by the notice's deadline)."""

    def __init__(
        self,
        storage: Storage,
        me: str,
        budget_s: float,
        *,
        announce_s: float = ANNOUNCE_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._storage, self._me, self._clock, self._announce_s = storage, me, clock, announce_s
        self._t0 = clock()
        self._end = self._t0 + max(0.0, budget_s)
        self._done = threading.Event()
        self.reason: str | None = None
        self._thread = threading.Thread(target=self._poll, name="spotrun-handover", daemon=True)
        self._thread.start()

    @property
    def ready(self) -> bool:
        """Whether training should stop now. The time limit is also read here, on the caller's clock:
        a storage read that hangs (an S3 endpoint gone) must not keep the loop training past it."""
        if self._clock() >= self._end:
            self.end(NO_TIME_LEFT)
        return self._done.is_set()

    def end(self, reason: str) -> None:
        """Stop now, whatever the replacement does."""
        if not self._done.is_set():
            self.reason = reason
            self._done.set()

    @property
    def waited_s(self) -> float:
        return self._clock() - self._t0

    def _poll(self) -> None:
        while not self._done.is_set():
            standby = read_standby(self._storage)
            now = self._clock()
            why = stop_now(
                standby, self._me, now - self._t0, left_s=self._end - now, announce_s=self._announce_s
            )
            if why is not None:
                self.end(why)
                return
            time.sleep(POLL_S)
