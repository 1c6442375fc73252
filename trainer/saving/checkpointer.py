"""Asynchronous checkpointing: the loop blocks only for the snapshot into host memory.

Pipeline per checkpoint, off the loop (trainer/saving/publish.py): write the step directory locally (fsynced
and hashed in one pass, manifest last, one rename) -> upload every file, then the checkpoint's sidecars
(the per-step metrics it covers, trainer/telemetry/metrics_log.py), manifest last -> confirm each stored
object against the manifest (S3's checksum on receipt, or the digest read back) -> move `latest` ->
retention. It runs in a writer process fed through shared memory (trainer/saving/writer_proc.py) for states
of PROCESS_MIN_BYTES and more, else in a background thread. A failure anywhere is kept and raised in
the loop at its next `check()`, so training never runs on believing a checkpoint exists that does not.

Fencing: the storage given to a trainer is a `lease.FencedStorage`, which refuses every write once the
lease is lost (and re-reads the lease before a manifest, `latest` or COMPLETED.json); the LeaseLost
reaches the loop as itself, so the exit code says "someone else writes here" rather than a crash.
"""

from __future__ import annotations

import _thread
import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from spotrun.trainer.checkpoint.catalog import apply_retention, prune_local
from spotrun.trainer.checkpoint.state import Snapshotter, TornSnapshot, state_nbytes
from spotrun.trainer.errors import CheckpointError, LeaseLost
from spotrun.trainer.saving.publish import Sidecars, persist
from spotrun.trainer.saving.publish import (
    put_sidecars as put_sidecars,  # read from here by sharded.py and tests
)
from spotrun.trainer.saving.publish import refused as refused
from spotrun.trainer.saving.publish import verify_remote as verify_remote
from spotrun.trainer.saving.shm import SharedSnapshotter
from spotrun.trainer.saving.writer_proc import WriterProcess, opener_of
from spotrun.trainer.storage import Storage

log = logging.getLogger(__name__)

WRITER_NICE = 10
AUTO, PROCESS, THREAD = "auto", "process", "thread"
WRITERS = (AUTO, PROCESS, THREAD)
# Below this the writer stays a thread: a small state's write takes milliseconds, while a second
# process costs ~1.5 s of CPU to import torch (on 2 cores, beside the trainer's own start-up).
PROCESS_MIN_BYTES = 64 * 2**20


# on_durable(step, sidecars_written): the checkpoint at `step` is durable, with its sidecars unless
# the second argument is False (their write failed; the caller carries their content to the next one)
OnDurable = Callable[[int, bool], None]


@dataclass
class SaveTimings:
    step: int
    snapshot_s: float = 0.0
    write_s: float = 0.0
    upload_s: float = 0.0
    verify_s: float = 0.0
    nbytes: int = 0  # the checkpoint's files, as the manifest lists them

    @property
    def total_s(self) -> float:
        return self.snapshot_s + self.write_s + self.upload_s + self.verify_s


class BackgroundSaver:
    """One checkpoint in flight at a time, persisted by a thread; its failure is kept and raised in the
    loop at the next `check()`. What the two checkpointers (one process, ranks) share."""

    def __init__(self, durable_step: int | None, on_durable: OnDurable | None) -> None:
        # torch.save's zip CRC32s tripled the write time of 1 GB (3.4 s vs 1.0 s, measured), and
        # torch.load never checks them; the manifest's SHA-256 is the integrity check. Process-wide.
        torch.serialization.set_crc32_options(False)
        self.durable_step = durable_step
        self.on_durable = on_durable
        self.history: list[SaveTimings] = []
        self._done: threading.Event | None = None  # the in-flight save's, set when it ends
        # whether a background save may leave what only the update changes to the writer's copy
        # (LaterCopies); off for good once a model wrote such a tensor outside the update
        self.overlap = True
        # the in-flight save's, set once it holds its own copy of what the optimizer's update changes
        self._copied: threading.Event | None = None
        self._error: BaseException | None = None
        self._lock = threading.Lock()

    def check(self) -> None:
        """Raise the background failure, if one happened."""
        with self._lock:
            err, self._error = self._error, None
        if isinstance(err, LeaseLost):
            raise err  # not a failed save: this trainer may no longer save at all
        if err is not None:
            raise CheckpointError(f"checkpoint failed: {type(err).__name__}: {err}") from err

    @property
    def failed(self) -> bool:
        """Whether a background save ended in an error that `check()` would raise."""
        return self._error is not None

    def wait(self) -> None:
        """Block until the in-flight checkpoint is durable (or failed: then raise)."""
        if self._done is not None:
            self._done.wait()
            self._done = None
        self._copied = None
        self.check()

    def fence(self) -> float:
        """Before the optimizer's update: block until the save in flight no longer reads the live
        parameters and optimizer state. Returns the seconds blocked (0 when nothing is copying)."""
        copied = self._copied
        if copied is None or copied.is_set():
            self._copied = None
            return 0.0
        t0 = time.perf_counter()
        copied.wait()
        self._copied = None
        return time.perf_counter() - t0

    def bandwidth(self, recent: int = 3) -> tuple[float, float] | None:
        """(write, upload) bytes/s of the slowest of the last `recent` checkpoints; None before any.

        Write covers snapshot + local write; upload covers upload + read-back + `latest`: together
        the time from the step boundary to durable."""
        timed = [t for t in self.history[-recent:] if t.nbytes > 0]
        if not timed:
            return None
        write = min(t.nbytes / max(t.snapshot_s + t.write_s, 1e-3) for t in timed)
        upload = min(t.nbytes / max(t.upload_s + t.verify_s, 1e-3) for t in timed)
        return write, upload

    @property
    def in_flight(self) -> bool:
        return self._done is not None and not self._done.is_set()

    def close(self) -> None:
        """Release what the saver holds beyond the attempt (buffers of a stager)."""

    def _persist_in(
        self,
        background: bool,
        persist: Callable[..., None],
        *args: Any,
        nice: bool = True,
        copy: Callable[[], None] | None = None,
    ) -> None:
        """Run `copy()`, then `persist(*args)`, in the writer thread (persist at a lower priority unless
        not `nice`: then `persist` lowers it itself when it may), or here (then raise its failure at
        once). `copy` finishes the snapshot: what only the optimizer's update changes, copied while
        the next step's forward and backward run, at normal priority; `fence()` waits for it."""
        if not background:
            self._guarded(copy, None, persist, False, *args)
            self.check()
            return
        # A bare thread: threading.Thread.start() waits until the new thread runs, which took 0.8 ms of
        # a 13 ms stall on 2 busy cores (measured); this one ends like a daemon thread.
        done, copied = threading.Event(), threading.Event() if copy is not None else None
        _thread.start_new_thread(self._run_job, (done, copy, copied, persist, nice, *args))
        self._done = done  # only once it runs: a thread that could not start is no save in flight
        self._copied = copied

    @staticmethod
    def timed_copy(copy: Callable[[], None], t: SaveTimings) -> Callable[[], None]:
        """`copy`, its seconds added to the save's snapshot time: the copy is the same work whether
        the loop waits for it or the writer does it beside the next step, and `bandwidth()` (which
        plans an emergency save, all copied at the boundary) must count it."""

        def run() -> None:
            t0 = time.perf_counter()
            try:
                copy()
            finally:
                t.snapshot_s += time.perf_counter() - t0

        return run

    def _run_job(self, done: threading.Event, *job: Any) -> None:
        try:
            self._guarded(*job)
        finally:
            done.set()

    def _guarded(
        self,
        copy: Callable[[], None] | None,
        copied: threading.Event | None,
        persist: Callable[..., None],
        nice: bool,
        *args: Any,
    ) -> None:
        try:
            try:
                if copy is not None:
                    copy()
            finally:  # a failed copy frees the update too: the failure surfaces at the next check()
                if copied is not None:
                    copied.set()
            if nice and threading.current_thread() is not threading.main_thread():
                lower_thread_priority()
            persist(*args)
        except TornSnapshot as e:  # this one is not published; from now on all is copied at the save
            self.overlap = False
            log.warning("checkpoint skipped: %s; later checkpoints copy them at the step boundary", e)
        except BaseException as e:  # boundary of the writer thread: handed to the loop via check()
            with self._lock:
                self._error = e


class Checkpointer(BackgroundSaver):
    """The single-process checkpointer. Where the state is large enough to matter (PROCESS_MIN_BYTES)
    and the storage can be opened again elsewhere, the pipeline runs in a writer process fed through
    shared memory (trainer/saving/writer_proc.py); otherwise in the background thread. `writer` forces one."""

    def __init__(
        self,
        storage: Storage,
        cache: Path,
        keep: int,
        *,
        background: bool = True,
        pin_memory: bool = False,
        durable_step: int | None = None,
        on_durable: OnDurable | None = None,
        writer: str = AUTO,
        update_only: Callable[[], set[tuple[int, int]]] | None = None,
    ) -> None:
        """`update_only`: what only the optimizer's update writes (state.update_only_views); a
        background save leaves its copy to the writer, during the next step's forward and backward,
        and the loop's `fence()` holds that step's update until it is done. None: all at once."""
        super().__init__(durable_step, on_durable)
        self.update_only = update_only
        if writer not in WRITERS:
            raise ValueError(f"writer {writer!r}: use one of {', '.join(WRITERS)}")
        self.storage, self.cache, self.keep, self.background = storage, cache, keep, background
        self.writer = writer
        self.snapshotter = Snapshotter(pin_memory)
        self.pin_memory = pin_memory
        self._shared: SharedSnapshotter | None = None
        self._proc: WriterProcess | None = None

    @property
    def uses_process(self) -> bool:
        return self._proc is not None

    def save(
        self,
        state: dict[str, Any],
        manifest_base: dict[str, Any],
        wait: bool = False,
        sidecars: Sidecars | None = None,
    ) -> float:
        """Snapshot `state` and persist it (in the background unless `wait`), with `sidecars` written
        before its manifest. Returns the seconds blocked."""
        t0 = time.perf_counter()
        # One in flight at a time: the buffers are reused, and publication order must follow step order.
        self.wait()
        step = int(manifest_base["step"])
        background = self.background and not wait
        later = self.update_only() if background and self.overlap and self.update_only is not None else None
        if self._process_for(state, wait):
            assert self._shared is not None
            snap, copies = self._shared.snapshot(state, later), self._shared.later
            timings = SaveTimings(step, snapshot_s=self._shared.last_seconds)
            persist: Callable[..., None] = self._persist_remote
        else:
            snap, copies = self.snapshotter.snapshot(state, later), self.snapshotter.later
            timings = SaveTimings(step, snapshot_s=self.snapshotter.last_seconds)
            persist = self._persist
        copy = self.timed_copy(copies.run, timings) if copies.pending else None
        self._persist_in(background, persist, snap, manifest_base, sidecars or {}, timings, copy=copy)
        return time.perf_counter() - t0

    def close(self) -> None:
        if self._proc is not None:
            self._proc.close()
            self._proc = None
        if self._shared is not None:
            self._shared.close()
            self._shared = None

    def _process_for(self, state: dict[str, Any], wait: bool) -> bool:
        """Whether this save goes to the writer process (starting it on the first that should)."""
        if self._proc is not None:
            return True  # decided once; a dead writer fails this save too (CheckpointError)
        wanted = self.writer == PROCESS or (
            self.writer == AUTO and self.background and state_nbytes(state) >= PROCESS_MIN_BYTES
        )
        # an emergency save does not wait for a writer to import torch: the thread is ready now
        reopen = opener_of(self.storage) if wanted and not wait else None
        if reopen is None:
            return False
        self._proc = WriterProcess(reopen[0], reopen[1], self.cache, self.keep)
        self._shared = SharedSnapshotter(self.pin_memory)
        log.info(
            "checkpoint writer process %d started (state %.0f MB)",
            self._proc.proc.pid,
            state_nbytes(state) / 2**20,
        )
        return True

    def _persist_remote(self, snap: Any, base: dict[str, Any], sidecars: Sidecars, t: SaveTimings) -> None:
        assert self._proc is not None and self._shared is not None and self._shared.arena is not None
        done = self._proc.persist(
            snap, self._shared.arena.fd, self._shared.generation, base=base, sidecars=sidecars
        )
        t.write_s, t.upload_s, t.verify_s, t.nbytes = done.write_s, done.upload_s, done.verify_s, done.nbytes
        self._record(done.step, t, done.sidecars_written, where="writer process")

    def _persist(
        self, snap: dict[str, Any], base: dict[str, Any], sidecars: Sidecars, t: SaveTimings
    ) -> None:
        done = persist(self.storage, self.cache, snap, base=base, sidecars=sidecars)
        step = done.manifest.step
        t.write_s, t.upload_s, t.verify_s = done.write_s, done.upload_s, done.verify_s
        t.nbytes = done.nbytes
        self._record(step, t, done.sidecars_written, where="thread")
        apply_retention(self.storage, step, self.keep)
        prune_local(self.cache, {step})

    def _record(self, step: int, t: SaveTimings, sidecars_written: bool, where: str) -> None:
        self.durable_step = step
        self.history.append(t)
        if self.on_durable is not None:
            self.on_durable(step, sidecars_written)
        log.info(
            "checkpoint step %d durable in %s (snapshot %.3fs, write %.2fs, upload %.2fs, verify %.2fs; %s)",
            step,
            self.storage.uri,
            t.snapshot_s,
            t.write_s,
            t.upload_s,
            t.verify_s,
            where,
        )


def lower_thread_priority() -> None:
    # On Linux a thread is a task with its own nice value. Serialization, hashing and copying
    # compete with the training step for the same cores; at nice 10 the writer mostly fills the
    # gaps the step leaves, and the loop keeps its speed (background work is not on the critical
    # path: the next save waits for it, and an emergency save runs on the main thread).
    with contextlib.suppress(OSError, AttributeError):  # not Linux, or not permitted: normal priority
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), WRITER_NICE)
