"""Sharded checkpoints (the sharded layout): DCP writes the shards, our commit protocol publishes them.

Per checkpoint, on every rank:
  1. stage   this rank's shard of model + optimizer is copied into reused host buffers (on CUDA by
             `dcp.async_save`, pinned) and the save returns: the only part that blocks the loop. The
             torch parts (scheduler, trainer meta, this rank's RNG) are snapshotted beside it.
  2. write   DCP writes `__<rank>_0.distcp` (rank 0 also `.metadata`), fsynced, in a thread: into the
             node's cache (S3), or into a staging directory of this rank's own inside a directory
             store. Each rank then writes and hashes its own `.pt` files and hashes its shard; rank 0
             deletes an earlier attempt's manifest of the step, and once it has, every rank uploads
             its files (a directory store: renames them into their keys) and reports
             {file: size, digest} (or its error).
  3. commit  rank 0 gathers every rank's report over the checkpoint group; only when all are durable it
             writes the manifest (every shard, `.metadata`, every `.pt`), stores it last, confirms the
             files against it (S3: size and S3's checksum; a directory store: nothing to read back),
             moves `latest`, and broadcasts the verdict: every rank knows the same durable step, and a
             failure anywhere fails the checkpoint everywhere.

DCP's collectives and ours run on the checkpoint group (gloo) from one thread per rank, one checkpoint
in flight at a time, so they never interleave with training's collectives or with each other.
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from spotrun.trainer.checkpoint.catalog import apply_retention, prune_local, write_latest
from spotrun.trainer.checkpoint.format import (
    MANIFEST,
    SHARDED,
    FileEntry,
    Manifest,
    file_entry,
    fsync_file,
    step_dir,
    write_part,
)
from spotrun.trainer.checkpoint.safe_load import SafeFileSystemReader, SafeLoadPlanner
from spotrun.trainer.checkpoint.signing import keyring
from spotrun.trainer.checkpoint.state import (
    LaterCopies,
    Snapshotter,
    TornSnapshot,
    host_copy,
    iter_tensors,
    local_of,
    update_only_views,
    view_of,
)
from spotrun.trainer.checkpoint.stateful import DCP_METADATA, Registry, spec_of
from spotrun.trainer.distributed.ranks import Ranks
from spotrun.trainer.errors import CheckpointError, LeaseLost, StorageError
from spotrun.trainer.saving.checkpointer import (
    BackgroundSaver,
    OnDurable,
    SaveTimings,
    Sidecars,
    lower_thread_priority,
    put_sidecars,
    refused,
    verify_remote,
)
from spotrun.trainer.storage import Storage
from spotrun.trainer.storage.local import fsync_dir

log = logging.getLogger(__name__)


def dcp_state(registry: Registry) -> dict[str, Any]:
    """Model and optimizer as DCP sees them: FQN-keyed, DTensor shards under FSDP2, no DDP prefix."""
    msd, osd = get_state_dict(registry["model"], registry["optimizer"])  # type: ignore[arg-type]
    return {"model": msd, "optimizer": osd}


def load_sharded(path: Path, registry: Registry, ranks: Ranks) -> None:
    """Load model and optimizer from a sharded checkpoint directory into this rank's shards. DCP reshards when
    the checkpoint's world size differs (each rank reads the pieces it now owns from any shard)."""
    state = dcp_state(registry)  # a fresh optimizer gets its state allocated (a zero-lr step) to load into
    listed = Manifest.from_json((path / MANIFEST).read_bytes()).files  # validated before this load
    dcp.load(
        state,
        checkpoint_id=str(path),
        storage_reader=SafeFileSystemReader(path, listed),
        planner=SafeLoadPlanner(),
        process_group=ranks.ckpt_group,
    )
    set_state_dict(
        registry["model"],  # type: ignore[arg-type]
        registry["optimizer"],  # type: ignore[arg-type]
        model_state_dict=state["model"],
        optim_state_dict=state["optimizer"],
    )


class DcpStateCache:
    """`dcp_state`'s answer, kept from one save to the next while it still describes the live state.

    `get_state_dict` rebuilds the FQN-keyed state on every call, mapping each optimizer state to its
    parameter's name: 16 ms of a 21 ms stall for a 110 MB charlm state under FSDP2 on 2 CPU ranks
    (bench/checkpoint_fsdp.py). The tensors it returns are views of the live parameters and optimizer
    states, which training updates in place, so the same dict holds the current values at the next
    save. Reused only while every tensor in it still views the storage of a live one and the
    optimizer holds the same number of states (a state made lazily by the first step, a load, or a
    reallocated parameter all rebuild it); the param groups' scalars (the learning rate) are copied
    fresh each time. What a reused dict stages is what a fresh one would: tests/e2e/test_distributed.py
    resumes FSDP2 and DDP jobs bitwise through it."""

    def __init__(self) -> None:
        self._state: dict[str, Any] | None = None
        self._views: list[tuple[int, int]] = []  # each tensor's (storage address, byte offset)
        self._count = (-1, -1)
        # ids of the returned state's tensors that only the optimizer's update writes (update_only_views)
        self.update_only: set[int] = set()

    def get(self, registry: Registry) -> dict[str, Any]:
        optimizer: Any = registry["optimizer"]
        if self._state is not None and _count(optimizer) == self._count:
            live = _live_views(registry)
            if all(v in live for v in self._views) and _refresh_groups(self._state["optimizer"], optimizer):
                return self._state
        state = dcp_state(registry)
        views = [(t, view_of(t)) for _, t in iter_tensors(state)]
        later = update_only_views(registry["model"], registry["optimizer"])
        self.update_only = {id(t) for t, v in views if v in later}
        if _holds_values(state["model"]):  # a module's get_extra_state(): only a fresh call is current
            self._state = None
            return state
        self._state = state
        self._views = [v for _, v in views]
        self._count = _count(optimizer)  # after: get_state_dict makes a fresh optimizer's state itself
        return self._state


def _count(optimizer: Any) -> tuple[int, int]:
    return len(optimizer.state), sum(len(s) for s in optimizer.state.values())


def _live_views(registry: Registry) -> set[tuple[int, int]]:
    model: Any = registry["model"]
    optimizer: Any = registry["optimizer"]
    live = [*model.parameters(), *model.buffers()]
    live += [t for s in optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    return {view_of(t) for t in live}


def _refresh_groups(osd: dict[str, Any], optimizer: Any) -> bool:
    """Copy each group's scalars (lr, ...) into the kept state; False when the groups changed."""
    if len(osd["param_groups"]) != len(optimizer.param_groups):
        return False
    for cached, group in zip(osd["param_groups"], optimizer.param_groups, strict=True):
        cached.update({k: v for k, v in group.items() if k != "params"})
    return True


def _holds_values(state: Any) -> bool:
    """Whether a model state dict holds anything but tensors (a module's extra state)."""
    if isinstance(state, dict):
        return any(_holds_values(v) for v in state.values())
    return not isinstance(state, torch.Tensor)


class ShardStager:
    """This rank's shards copied into host buffers that are reused, checkpoint after checkpoint.

    DCP's own stager deep-copies every tensor of the state dict, one Python call chain per tensor:
    45-60 ms of a 62 ms stall for a 110 MB charlm state on 2 CPU ranks (~200 sharded tensors, profiled),
    while copying the same bytes into reused buffers takes 5-10 ms. Here each tensor's buffer, and the
    DTensor that wraps it for DCP, are made once; a save copies into them. Non-tensor values (the
    optimizer's learning rate) are taken fresh from each state dict. Used on CPU; on CUDA DCP's stager
    copies into pinned memory, the path PyTorch tests (our own staging there is not measured yet)."""

    def __init__(self) -> None:
        self._staged: dict[str, Any] = {}  # path -> staged tensor (a DTensor over a reused buffer)
        self._buffers: dict[str, torch.Tensor] = {}
        self.later = LaterCopies()

    def stage(self, state: Any, later: set[int] | None = None) -> Any:
        """The staged state dict. Its tensors whose ids are in `later` (what only the optimizer's
        update changes: DcpStateCache.update_only) wait for `later.run()`, others are copied now."""
        self.later.start(None)
        return self._stage(state, "", later or set())

    def _stage(self, state: Any, path: str, later: set[int]) -> Any:
        from torch.distributed.tensor import DTensor

        if isinstance(state, dict):
            return {k: self._stage(v, f"{path}/{k}", later) for k, v in state.items()}
        if isinstance(state, list):
            return [self._stage(v, f"{path}/{i}", later) for i, v in enumerate(state)]
        if not isinstance(state, torch.Tensor):
            return state
        local = local_of(state)
        buf = self._buffers.get(path)
        if buf is None or buf.shape != local.shape or buf.dtype != local.dtype:
            buf = torch.empty_like(local, device="cpu")
            self._buffers[path] = buf
            self._staged[path] = buf
            if isinstance(state, DTensor):
                self._staged[path] = DTensor.from_local(
                    buf,
                    state.device_mesh,
                    state.placements,
                    run_check=False,
                    shape=state.shape,
                    stride=state.stride(),
                )
        if id(state) in later:  # known by id: the state dict is DcpStateCache's, kept between saves
            self.later.defer(buf, local.detach())
        else:
            host_copy(buf, local.detach())  # one memmove where it can (trainer/checkpoint/state.py)
        return self._staged[path]


class ShardedCheckpointer(BackgroundSaver):
    """The Checkpointer's interface (save, check, wait, bandwidth) for a job's ranks."""

    def __init__(
        self,
        storage: Storage,
        cache: Path,
        keep: int,
        *,
        registry: Registry,
        ranks: Ranks,
        background: bool = True,
        pin_memory: bool = False,
        durable_step: int | None = None,
        on_durable: OnDurable | None = None,
        strategy: str | None = None,
    ) -> None:
        super().__init__(durable_step, on_durable)
        self.storage, self.cache, self.keep, self.background = storage, cache, keep, background
        self.registry, self.ranks, self.strategy = registry, ranks, strategy
        self.snapshotter = Snapshotter(pin_memory)
        self.stager = _stager(pin_memory)
        self.own_staging = not (pin_memory and torch.cuda.is_available())
        self.shard_stager = ShardStager()
        self._torn: Exception | None = None  # this rank's writer copy failed or torn (told in _commit)
        self.dcp_cache = DcpStateCache()
        # One temp directory name for all ranks of the attempt (ranks of a node share it).
        self._tag = ranks.broadcast(f"{os.getpid()}")

    def save(
        self,
        state: dict[str, Any],
        manifest_base: dict[str, Any],
        wait: bool = False,
        sidecars: Sidecars | None = None,
    ) -> float:
        """Stage this rank's shard and snapshot its other parts, then persist (in the background unless
        `wait`); rank 0 writes `sidecars` before the manifest. Every rank calls it at the same step.
        Returns the seconds the loop was blocked."""
        t0 = time.perf_counter()
        self.wait()
        self._torn = None
        step = int(manifest_base["step"])
        # A directory store gives each rank a new directory of its own on the store's file system: DCP
        # writes there in place and each file is renamed into its key (as `checkpointer.persist` does),
        # with no copy and no read-back. Otherwise the step is written in the node's cache, uploaded.
        staging = self.storage.staging()
        tmp = staging / step_dir(step) if staging else self.cache / f".tmp-{step_dir(step)}-{self._tag}"
        tmp.mkdir(parents=True, exist_ok=True)
        try:
            snap = self.snapshotter.snapshot(state)
            shards = self.dcp_cache.get(self.registry)
            timings = SaveTimings(step)
            background = self.background and not wait
            future, staged = None, None
            copy = None
            if background and self.own_staging:  # staged here; written by dcp.save in the writer thread
                # what only the update changes is copied by the writer thread, overlapping the next
                # step's forward and backward; the loop's fence() holds the update until it is done
                staged = self.shard_stager.stage(shards, self.dcp_cache.update_only if self.overlap else None)
                copy = self.timed_copy(self._copy_later, timings) if self.shard_stager.later.pending else None
            elif background:
                future = dcp.async_save(
                    shards,
                    checkpoint_id=str(tmp),
                    process_group=self.ranks.ckpt_group,
                    async_stager=self.stager,
                    planner=_planner(),
                )
            else:
                dcp.save(
                    shards, checkpoint_id=str(tmp), process_group=self.ranks.ckpt_group, planner=_planner()
                )
        except BaseException:
            if staging is not None:  # nothing of a failed save may stay in the store
                shutil.rmtree(staging, ignore_errors=True)
            raise
        timings.snapshot_s = time.perf_counter() - t0
        self._persist_in(
            background,
            self._commit,
            future,
            staged,
            tmp,
            staging,
            snap,
            manifest_base,
            sidecars or {},
            timings,
            nice=False,
            copy=copy,
        )
        return time.perf_counter() - t0

    def close(self) -> None:
        self.stager.close()

    def _copy_later(self) -> None:
        """The writer's part of the staging copy. Its failure (a torn snapshot or any other) is not
        raised here, where it would end this rank's save alone while the others wait in DCP's
        collectives, but in `_commit` after them, where every rank learns of it."""
        try:
            self.shard_stager.later.run()
        except Exception as e:
            self._torn = e

    def _commit(
        self,
        future: Any,
        staged: dict[str, Any] | None,
        tmp: Path,
        staging: Path | None,
        snap: dict[str, Any],
        base: dict[str, Any],
        sidecars: Sidecars,
        t: SaveTimings,
    ) -> None:
        step, rank = t.step, self.ranks.rank
        files: dict[str, FileEntry] = {}
        failed: Failed | None = None
        t0 = time.perf_counter()
        try:
            if future is not None:
                future.result()
            elif staged is not None:  # our own staging: DCP writes the staged copy from this thread
                # at normal priority: its planning collectives hold every rank up (the whole save at nice 10
                # took 0.73-1.0 s against 0.42-0.49 s at normal priority, measured); hashing and uploads
                # below may yield to training
                dcp.save(
                    staged, checkpoint_id=str(tmp), process_group=self.ranks.ckpt_group, planner=_planner()
                )
            if threading.current_thread() is not threading.main_thread():
                lower_thread_priority()
            files = self._write_own(tmp, snap, step)
            if rank == 0:  # an earlier attempt's manifest of this step: gone before any new file lands
                self.storage.delete([f"{step_dir(step)}/{MANIFEST}"])
            torn, self._torn = self._torn, None
            if torn is not None:  # only now: DCP's collectives above need every rank
                raise torn
        except (Exception, CheckpointException) as e:  # to rank 0 (every rank must reach the gather)
            failed = Failed.of(rank, e, self.storage)
        self.ranks.broadcast(None)  # every rank waits for that delete (all reach it, failed or not)
        t1 = time.perf_counter()
        if failed is None:
            try:
                own = [(f"{step_dir(step)}/{fname}", tmp / fname) for fname in sorted(files)]
                if staging is not None:
                    self.storage.adopt(own)
                else:
                    for key, src in own:
                        self.storage.put(key, src)
            except Exception as e:
                failed = Failed.of(rank, e, self.storage)
        t.write_s, t.upload_s = t1 - t0, time.perf_counter() - t1
        report = (files, None) if failed is None else ({}, failed)
        reports = self.ranks.gather(report)
        verdict: tuple[int | None, Failed | None] = (None, None)
        written = True  # what the other ranks report: their MetricsLog records nothing
        if reports is not None:  # rank 0
            verdict, written = self._publish(
                tmp, staging is not None, base, sidecars=sidecars, reports=reports, t=t
            )
        durable, error = self.ranks.broadcast(verdict)
        if staging is not None:  # adopted, or a failed save's remains: nothing of it stays in the store
            shutil.rmtree(staging, ignore_errors=True)
        elif rank != 0:  # another node's copy, or already renamed by rank 0
            shutil.rmtree(tmp, ignore_errors=True)
        if error is not None and error.lost:  # rank 0 found the lease taken: every rank stops publishing
            # rank 0 says it (trainer/__main__.py), unless its lease said it when it found the loss
            raise LeaseLost(error.why, taken_by=error.taken_by).mark(echo=rank != 0, logged=error.logged)
        if error is not None and error.torn:  # every rank skips this one, and copies all at the save on
            self.overlap = False
            if rank == 0:
                log.warning(
                    "checkpoint step %d skipped: %s; later checkpoints copy them at the step boundary",
                    step,
                    error.why,
                )
            return
        if error is not None:  # on every rank; a refusing store is one line, not retried (as alone)
            raise CheckpointError(error.why) from (StorageError(error.why) if error.refused else None)
        assert durable is not None
        t.nbytes = sum(e.size for e in report[0].values())
        self.durable_step = durable
        self.history.append(t)
        if self.on_durable is not None:
            self.on_durable(durable, written)
        if rank == 0:
            log.info(
                "checkpoint step %d durable in %s (%d ranks; stage %.3fs, write %.2fs, upload %.2fs, "
                "verify %.2fs)",
                durable,
                self.storage.uri,
                self.ranks.world_size,
                t.snapshot_s,
                t.write_s,
                t.upload_s,
                t.verify_s,
            )
            apply_retention(self.storage, durable, self.keep)
        if self.ranks.local_rank == 0:
            prune_local(self.cache, {durable})

    def _write_own(self, tmp: Path, snap: dict[str, Any], step: int) -> dict[str, FileEntry]:
        """This rank's `.pt` files (rank 0: the shared parts too), and the hashes of its DCP files."""
        rank, files = self.ranks.rank, {}
        for name, state in snap.items():
            spec = spec_of(name, sharded=True)
            if state is None or (not spec.per_rank and rank != 0):
                continue
            fname = spec.file_for(rank)
            files[fname] = write_part(tmp / fname, spec.codec, state, step=step)
        own = sorted(tmp.glob(f"__{rank}_*.distcp")) + ([tmp / DCP_METADATA] if rank == 0 else [])
        key = keyring().signing
        for p in own:  # DCP fsyncs what it writes (FileSystemWriter sync_files)
            files[p.name] = file_entry(p, key=key)
        return files

    def _publish(
        self,
        tmp: Path,
        adopt: bool,
        base: dict[str, Any],
        *,
        sidecars: Sidecars,
        reports: list[tuple[dict[str, FileEntry], Failed | None]],
        t: SaveTimings,
    ) -> tuple[tuple[int | None, Failed | None], bool]:
        """Rank 0, once every rank reported: the sidecars, the manifest, read-back, `latest`.
        Returns ((step, None), whether the sidecars were written), or ((None, why), False)."""
        errors = [e for _, e in reports if e]
        if errors:  # a lost lease outweighs a real failure, which outweighs a torn snapshot (skipped)
            return (None, min(errors, key=lambda e: (not e.lost, e.torn))), False
        try:
            files: dict[str, FileEntry] = {}
            for f, _ in reports:
                files |= f
            manifest = Manifest(files=files, layout=SHARDED, strategy=self.strategy, **base).signed()
            name = step_dir(manifest.step)
            body = manifest.to_json()
            (tmp / MANIFEST).write_bytes(body)
            t0 = time.perf_counter()
            written = put_sidecars(self.storage, sidecars)
            if adopt:  # every file is the one hashed after DCP wrote it: nothing to read back
                fsync_file(tmp / MANIFEST)
                self.storage.adopt([(f"{name}/{MANIFEST}", tmp / MANIFEST)])
            else:
                self.storage.put(f"{name}/{MANIFEST}", tmp / MANIFEST)
                verify_remote(self.storage, manifest)
            write_latest(self.storage, manifest.step)
            t.verify_s = time.perf_counter() - t0
            if not adopt:
                self._keep_local(tmp, manifest)
            return (manifest.step, None), written
        except Exception as e:  # a LeaseLost too: broadcast, so the other ranks stop with rank 0
            return (None, Failed.of(0, e, self.storage)), False

    def _keep_local(self, tmp: Path, manifest: Manifest) -> None:
        """The local copy becomes a committed checkpoint when it holds every file (one node); otherwise
        it loses its manifest, and a resume on this node fetches the other nodes' shards first."""
        final = self.cache / step_dir(manifest.step)
        if not all((tmp / f).is_file() for f in manifest.files):
            (tmp / MANIFEST).unlink(missing_ok=True)
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        fsync_dir(self.cache)


@dataclass(frozen=True)
class Failed:
    """One rank's failed part of a save, as it travels to every rank."""

    why: str
    refused: bool  # the store refuses writes (full, read-only): one line, not retried
    torn: bool = False  # a rank's snapshot was written during its copy (TornSnapshot): skipped
    # rank 0 lost the job's lease (LeaseLost, raised on every rank): it may publish nothing more
    lost: bool = False
    taken_by: str | None = None  # the lease's new holder, when it was taken over
    logged: bool = False  # rank 0's lease logged the loss as it found it

    @classmethod
    def of(cls, rank: int, e: BaseException, storage: Storage) -> Failed:
        if isinstance(e, LeaseLost):
            return cls(str(e), False, lost=True, taken_by=e.taken_by, logged=e.logged)
        mapped = refused(e, storage)
        if mapped is not None:
            return cls(f"rank {rank}: {mapped}"[:400], True)
        return cls(f"rank {rank}: {type(e).__name__}: {e}"[:400], False, isinstance(e, TornSnapshot))


def _planner() -> Any:
    """DCP's save planner with its plan cache: a save whose local plans equal the last one's sends
    empty plans through the planning collectives and reuses the cached global plan and metadata
    (every save of an attempt has the same tensors). On 2 gloo ranks, 55 MB a rank, dcp.save's median
    went from ~0.54 s to ~0.36 s and time to durable from 0.41-0.44 s to 0.31-0.33 s (two runs each,
    measured 2026-12-03). The cache is DCP's, per process and keyed by the planner's class."""
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    return DefaultSavePlanner(enable_plan_caching=True)


def _stager(pin_memory: bool) -> Any:
    """DCP's stager, reused across checkpoints: pinned host buffers on CUDA (copies at full bandwidth)."""
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    cuda = pin_memory and torch.cuda.is_available()
    return DefaultStager(
        StagingOptions(
            use_pinned_memory=cuda,
            use_shared_memory=False,
            use_async_staging=False,
            use_non_blocking_copy=cuda,
        )
    )
