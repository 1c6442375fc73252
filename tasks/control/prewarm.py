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

EC2 also sends a rebalance recommendation: an elevated risk of interruption, often minutes before the
notice, sometimes with no notice after it. Booting an instance takes most of the notice's two minutes,
so the controller starts the replacement already then (`start(..., stand_by_s=...)`) and the old
trainer trains on: it does not stop for a recommendation. The replacement waits `stand_by_s` for the
lease instead of PREWARM_WAIT_S; once less than PREWARM_WAIT_S of that is left with no notice, it is
released (a recommendation EC2 never followed up costs at most that long of a second worker) and a
later notice starts a fresh one. A notice within the window finds it standing by: the old trainer's
handover sees its `waiting` standby and stops at once.
"""

from __future__ import annotations

import contextvars
import logging
import threading
import time
from collections.abc import Callable

from spotrun.tasks.providers.base import Provider, ProvisionError, Worker

log = logging.getLogger(__name__)

# How long a prewarmed trainer waits for the lease: the longest notice (AWS: 2 min) plus the old
# worker's exit and release. It gives up with LEASE_HELD after that (a retry then starts cold).
PREWARM_WAIT_S = 180.0


class Prewarm:
    """At most one worker started ahead of its attempt. `start` is idempotent and returns at once."""

    def __init__(
        self, provision: Callable[[list[str]], Worker], release: Callable[[Worker], None] | None = None
    ) -> None:
        self._provision = provision  # called with the trainer's extra arguments, in a thread
        self._release = release  # ends a replacement a rebalance started and no notice followed
        self._thread: threading.Thread | None = None
        self._worker: Worker | None = None
        self._error: BaseException | None = None
        self._timer: threading.Timer | None = None
        self._lock = threading.Lock()
        self.started_at: float | None = None
        self.reason = "prewarmed at the notice"  # why it was started (the next attempt's market_reason)

    @property
    def started(self) -> bool:
        return self._thread is not None

    @property
    def ready(self) -> bool:
        """Provisioned: its trainer is building or already waits on the lease."""
        return self._thread is not None and not self._thread.is_alive() and self._worker is not None

    @property
    def market(self) -> str | None:
        """The market its worker was rented on, once provisioned."""
        worker = self._worker
        return worker.market if worker is not None else None

    def failure(self) -> BaseException | None:
        """The error that ended its provisioning, once the thread is done (then it may be started again)."""
        with self._lock:
            if self._thread is None or self._thread.is_alive() or self._error is None:
                return None
            error, self._error, self._thread = self._error, None, None
            return error

    def start(
        self,
        args: Callable[[], list[str]],
        *,
        stand_by_s: float | None = None,
        reason: str | None = None,
        wait_s: float | None = None,
    ) -> None:
        """Provision in a thread, with `args()` (computed here, in the caller's thread) for the trainer.
        `stand_by_s`: started ahead of any notice (a rebalance recommendation), the replacement stands by
        this long; a later start (the notice) keeps it for good. `reason`: why (the next attempt's row).
        `wait_s`: the trainer's wait for the lease, where neither PREWARM_WAIT_S nor `stand_by_s` is it
        (a warm standby with no idle limit, tasks/control/warm.py)."""
        with self._lock:
            if self._thread is not None:
                if self._timer is not None and stand_by_s is None:
                    self._timer.cancel()  # the notice came: this replacement is needed
                    self._timer = None
                return
            if reason is not None:
                self.reason = reason
            self.started_at, self._error = time.time(), None
            wait = wait_s if wait_s is not None else PREWARM_WAIT_S if stand_by_s is None else stand_by_s
            extra = [*args(), "--prewarm-wait", f"{wait:g}"]
            # in the caller's context: what it reports (a market decision) lands in its Prefect task run
            ctx = contextvars.copy_context()
            self._thread = threading.Thread(
                target=ctx.run, args=(self._run, extra), name="spotrun-prewarm", daemon=True
            )
            if stand_by_s is not None and self._release is not None:
                self._timer = threading.Timer(max(0.0, stand_by_s - PREWARM_WAIT_S), self._expire)
                self._timer.daemon = True
                self._timer.start()
            self._thread.start()

    def _expire(self) -> None:
        """No notice within the stand-by window: release the replacement; a later notice starts anew."""
        with self._lock:  # held throughout: a take() meanwhile waits, then finds nothing
            if self._timer is None or self._thread is None:
                return  # taken or confirmed by a notice meanwhile
            self._thread.join()
            worker, self._worker = self._worker, None
            self._timer = self._thread = self._error = None
        if worker is not None and self._release is not None:
            self._release(worker)
            log.info("released standby worker %s: no notice came within its stand-by window", worker.id)

    def _run(self, extra: list[str]) -> None:
        try:
            self._worker = self._provision(extra)
        except BaseException as e:  # a failed prewarm only means the next attempt starts cold
            self._error = e

    def take(self) -> Worker | None:
        """The prewarmed worker (waiting for its thread), or None: none started, or it failed."""
        with self._lock:
            thread = self._thread
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
        if thread is None:
            return None
        thread.join()
        with self._lock:
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
