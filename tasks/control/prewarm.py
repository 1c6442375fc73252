"""Start the replacement at the notice: the next attempt's worker, provisioned while this one saves.

A reclaim with notice used to cost a whole cold start after the old worker was gone: process start,
`import torch` and the recipe's build and data load (3.5-5 s measured on a 2-core VM), plus an
instance's boot on EC2. The notice leaves 30 s to 2 min, and the emergency checkpoint needs a fraction
of it. So when a worker reports that it is stopping (a SIGTERM or a cloud notice reached its loop),
the controller provisions the next one at once, in a thread; that trainer builds everything, then
waits (`--prewarm-wait`) for the storage lease, which the old trainer gives back only after its
emergency checkpoint is durable, or which the controller hands over once it has released the old
worker (`_handoff.json`, trainer/preemption/lease.py). It therefore never loads a checkpoint that is not
durable. Meanwhile the old trainer trains on through its notice until this one stands by
(trainer/preemption/handover.py): the cold start overlaps training, not idle time.

If the attempt ends in a way that needs no replacement (completed, gave up, cancelled), the prewarmed
worker is released unused.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from tasks.providers.base import Provider, ProvisionError, Worker

log = logging.getLogger(__name__)

# How long a prewarmed trainer waits for the lease: the longest notice (AWS: 2 min) plus the old
# worker's exit and release. It gives up with LEASE_HELD after that (a retry then starts cold).
PREWARM_WAIT_S = 180.0


class Prewarm:
    """At most one worker started ahead of its attempt. `start` is idempotent and returns at once."""

    def __init__(self, provision: Callable[[list[str]], Worker]) -> None:
        self._provision = provision  # called with the trainer's extra arguments, in a thread
        self._thread: threading.Thread | None = None
        self._worker: Worker | None = None
        self._error: BaseException | None = None
        self.started_at: float | None = None
        self.reason = "prewarmed at the notice"  # why it was started (the next attempt's market_reason)

    @property
    def started(self) -> bool:
        return self._thread is not None

    @property
    def ready(self) -> bool:
        """Provisioned: its trainer is building or already waits on the lease."""
        return self._thread is not None and not self._thread.is_alive() and self._worker is not None

    def failure(self) -> BaseException | None:
        """The error that ended its provisioning, once the thread is done (then it may be started again)."""
        if self._thread is None or self._thread.is_alive() or self._error is None:
            return None
        error, self._error, self._thread = self._error, None, None
        return error

    def start(self, args: Callable[[], list[str]], reason: str | None = None) -> None:
        """Provision in a thread, with `args()` (computed here, in the caller's thread) for the trainer."""
        if self._thread is not None:
            return
        if reason is not None:
            self.reason = reason
        self.started_at = time.time()
        extra = [*args(), "--prewarm-wait", f"{PREWARM_WAIT_S:g}"]
        self._thread = threading.Thread(target=self._run, args=(extra,), name="spotrun-prewarm", daemon=True)
        self._thread.start()

    def _run(self, extra: list[str]) -> None:
        try:
            self._worker = self._provision(extra)
        except BaseException as e:  # a failed prewarm only means the next attempt starts cold
            self._error = e

    def take(self) -> Worker | None:
        """The prewarmed worker (waiting for its thread), or None: none started, or it failed."""
        if self._thread is None:
            return None
        self._thread.join()
        if self._error is not None:
            why = self._error if isinstance(self._error, ProvisionError) else repr(self._error)
            log.warning("prewarmed worker not provisioned (%s): the next attempt starts cold", why)
        worker, self._worker, self._thread = self._worker, None, None
        return worker

    def discard(self, provider: Provider) -> None:
        """Release a prewarmed worker nobody will use."""
        worker = self.take()
        if worker is not None:
            provider.release(worker)
            log.info("released prewarmed worker %s: no further attempt", worker.id)
