"""Capturing and restoring the full training state, and snapshotting it into host memory.

Everything captured here loads with `torch.load(weights_only=True)`: RNG states are stored as
tensors, ints and tuples (numpy's legacy tuple holds an ndarray, which weights_only rejects).
"""

from __future__ import annotations

import ctypes
import random
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch


def capture_rng(device: torch.device) -> dict[str, Any]:
    """Python, numpy, torch CPU and (when used) CUDA RNG states of this process."""
    name, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)  # type: ignore[misc]
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": {
            "name": str(name),
            "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64).copy()),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        },
        "torch": torch.get_rng_state(),
    }
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: dict[str, Any], device: torch.device) -> None:
    """Inverse of capture_rng. Call it after the epoch's data iterator exists (its creation draws RNG)."""
    random.setstate(_as_tuple(state["python"]))
    n = state["numpy"]
    np.random.set_state(
        (n["name"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["cached_gaussian"])
    )
    torch.set_rng_state(state["torch"])
    if device.type == "cuda":
        if "cuda" not in state:
            raise ValueError(
                "checkpoint has no CUDA RNG state (it was made on CPU); resume on CPU for exactness"
            )
        torch.cuda.set_rng_state_all(state["cuda"])


class RngState:
    """The RNG streams of this process as a `Stateful` checkpoint part (the registry's `rng`)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def state_dict(self) -> dict[str, Any]:
        return capture_rng(self.device)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        restore_rng(state, self.device)


def _as_tuple(x: Any) -> Any:
    # torch.load returns python's (version, tuple, gauss) state with lists where tuples were
    return tuple(_as_tuple(v) for v in x) if isinstance(x, list | tuple) else x


class TornSnapshot(Exception):
    """A tensor left to the writer's copy was written before that copy ended: the snapshot may hold
    values of a later step than the checkpoint names."""


class LaterCopies:
    """The part of a snapshot copied after the step boundary, by the writer, while the next step's
    forward and backward run: tensors in `update_only_views` (set per snapshot with `start`). The
    loop's fence holds the optimizer's update until `run()` is done (checkpointer.BackgroundSaver).
    At 1 GB of charlm state on 2 cores the copy is 0.22-0.28 s that the loop no longer waits for.

    Only the update should write these tensors, but a model may write a parameter in its forward
    (`nn.Embedding(max_norm=...)` renormalizes rows in place). Every in-place write bumps a tensor's
    version counter, which its views share: `run()` compares them after copying and raises
    TornSnapshot when any moved, so such a snapshot is never published. A write through `.data`,
    numpy or ctypes moves no counter: a loss_fn must not write the optimizer's parameters that way
    (docs/recipes.md)."""

    def __init__(self) -> None:
        self.views: set[tuple[int, int]] = set()
        self.pending: list[tuple[torch.Tensor, torch.Tensor, int]] = []

    def start(self, views: set[tuple[int, int]] | None) -> None:
        self.views, self.pending = views or set(), []

    def copy(self, dst: torch.Tensor, src: torch.Tensor, non_blocking: bool = False) -> None:
        """Copy now, or (a tensor only the update changes) leave it to `run()`."""
        if self.views and _plain_cpu(src) and view_of(src) in self.views:
            self.defer(dst, src)
        else:
            host_copy(dst, src, non_blocking=non_blocking)

    def defer(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        self.pending.append((dst, src, src._version))

    def run(self) -> None:
        pending, self.pending = self.pending, []
        for dst, src, _ in pending:
            host_copy(dst, src)
        written = sum(1 for _, src, version in pending if src._version != version)
        if written:
            raise TornSnapshot(
                f"{written} parameter or optimizer tensor(s) were written in place during the step after "
                "the save, before the checkpoint's copy of them ended (a forward that writes its weights, "
                "such as nn.Embedding(max_norm=...))"
            )


class Snapshotter:
    """Copies a nested state (dicts/lists/tuples of tensors and plain values) into preallocated
    host buffers, reused across checkpoints. This copy is the only part of a checkpoint that
    blocks the training loop (less what `later` leaves to the writer); on CUDA the buffers are
    pinned so the copy runs at full bandwidth."""

    def __init__(self, pin_memory: bool = False) -> None:
        self.pin_memory = pin_memory
        self._buffers: dict[str, torch.Tensor] = {}
        self.later = LaterCopies()
        self.last_seconds = 0.0

    def snapshot(self, state: Any, later: set[tuple[int, int]] | None = None) -> Any:
        """The copy; tensors whose data `later` holds (update_only_views) wait for `later.run()`."""
        t0 = time.perf_counter()
        self.later.start(later)
        out = _map_tensors(state, "", self._copy)
        if self.pin_memory and torch.cuda.is_available():
            torch.cuda.synchronize()  # non_blocking device->pinned copies must land before we hand off
        self.last_seconds = time.perf_counter() - t0
        return out

    def _copy(self, path: str, t: torch.Tensor) -> torch.Tensor:
        buf = self._buffers.get(path)
        if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
            buf = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=self.pin_memory)
            self._buffers[path] = buf
        self.later.copy(buf, t.detach(), non_blocking=self.pin_memory)
        return buf

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._buffers.values())


_PLAIN = (torch.Tensor, torch.nn.Parameter)


def host_copy(dst: torch.Tensor, src: torch.Tensor, non_blocking: bool = False) -> None:
    """`dst.copy_(src)` for a snapshot, as one memmove where both are plain contiguous CPU tensors of one
    dtype and size. torch's copy_ splits every tensor over the OpenMP threads, and with threads that
    sleep while they wait (OMP_WAIT_POLICY=PASSIVE, as the local provider runs trainers) each split
    costs a wake-up: a 109 MB charlm state (266 tensors, 66 of 2.2 MB) took 11.5 ms through copy_ and
    7.3 ms as memmoves on a 2-core VM (measured 2026-12-03; a second thread added nothing: memory-bound).
    Anything else (a device tensor, a subclass such as DTensor, a strided view, a lazy conj or neg)
    goes through copy_."""
    if (
        type(src) in _PLAIN
        and type(dst) in _PLAIN
        and src.device.type == "cpu"
        and dst.device.type == "cpu"
        and src.dtype == dst.dtype
        and src.shape == dst.shape
        and src.layout == torch.strided
        and src.is_contiguous()
        and dst.is_contiguous()
        and not src.is_conj()
        and not src.is_neg()
    ):
        n = src.numel() * src.element_size()
        if n:
            ctypes.memmove(dst.data_ptr(), src.data_ptr(), n)  # releases the GIL, like copy_
        return
    dst.copy_(src, non_blocking=non_blocking)


def _map_tensors(obj: Any, path: str, fn: Callable[[str, torch.Tensor], torch.Tensor]) -> Any:
    if isinstance(obj, torch.Tensor):
        return fn(path, obj)
    if isinstance(obj, dict):
        return {k: _map_tensors(v, f"{path}/{k}", fn) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_map_tensors(v, f"{path}/{i}", fn) for i, v in enumerate(obj)]
    if isinstance(obj, tuple):
        return tuple(_map_tensors(v, f"{path}/{i}", fn) for i, v in enumerate(obj))
    return obj  # ints, floats, str, None: immutable, safe to share with the writer thread


def iter_tensors(obj: Any, path: str = "") -> list[tuple[str, torch.Tensor]]:
    """All tensors in a nested state with their paths."""
    found: list[tuple[str, torch.Tensor]] = []

    def collect(p: str, t: torch.Tensor) -> torch.Tensor:
        found.append((p, t))
        return t

    _map_tensors(obj, path, collect)
    return found


def all_finite(t: torch.Tensor) -> bool:
    """No NaN/Inf in `t`. NaN propagates through aminmax and an Inf shows as the min or max: one
    reduction, exact, no temporaries (1 GB fp32: 0.04 s, vs 0.97 s for isfinite().all())."""
    if not t.is_floating_point() or t.numel() == 0:
        return True
    lo, hi = torch.aminmax(t)
    return bool(torch.isfinite(lo)) and bool(torch.isfinite(hi))


def state_nbytes(state: Any) -> int:
    """Bytes of tensor data in a nested state: what a checkpoint of it writes, near enough."""
    return sum(t.numel() * t.element_size() for _, t in iter_tensors(state))


def local_of(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's shard on this rank (the tensor itself otherwise), read from the attribute DTensor
    keeps it in: `to_local()` goes through an autograd function, ~20 us each, and a 110 MB charlm
    state has ~270 sharded tensors whose shards every save reads twice (a 5-7 ms check and the
    staging copy)."""
    local = getattr(t, "_local_tensor", None)
    if isinstance(local, torch.Tensor):
        return local
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def view_of(t: torch.Tensor) -> tuple[int, int]:
    """(storage address, byte offset) of a tensor's data, or its local shard's: equal for the live
    tensor and every view a state dict takes of it."""
    local = local_of(t)
    return local.untyped_storage().data_ptr(), int(local.storage_offset()) * local.element_size()


def update_only_views(model: Any, optimizer: Any) -> set[tuple[int, int]]:
    """The parameters and optimizer states in host memory: what only the optimizer's update writes.
    The forward and backward passes read them (FSDP2 all-gathers from the shards into buffers of its
    own and reduce-scatters into `.grad`), so a save may copy them during the next step's forward
    and backward, as CheckFreq does (Mohan et al., FAST '21). Buffers (a BatchNorm's running stats
    change in forward) and device tensors are left to the copy at the step boundary."""
    # the optimizer's own parameters only: a frozen weight or an EMA copy that a recipe's loss_fn
    # updates is a parameter the update does not write
    params = {id(p): p for group in optimizer.param_groups for p in group["params"]}
    live = [*params.values()]
    live += [t for s in optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    buffers = {view_of(b) for b in model.buffers() if _plain_cpu(b)}
    return {view_of(t) for t in live if _plain_cpu(t)} - buffers


def _plain_cpu(t: torch.Tensor) -> bool:
    """A dense tensor in host memory with a storage of its own (not sparse, not a wrapper subclass
    such as a quantized weight, which has none to compare): the only kind a copy is deferred for."""
    local = local_of(t)
    return type(local) in _PLAIN and local.layout == torch.strided and local.device.type == "cpu"
