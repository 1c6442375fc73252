"""Snapshot buffers in memory another process can map: what the checkpoint writer process reads.

One arena per layout: an anonymous memory file (`memfd_create`) holding every tensor of the state at
its own 64-byte-aligned offset. The training process copies its state into views of the arena (the
only part of a checkpoint that blocks the loop, as with `state.Snapshotter`); the writer process maps
the same file, from a descriptor passed once over its socket, and reads the tensors in place: no
pickling of tensor data, no second copy.

Why memfd and not `/dev/shm` (torch's own sharing): a container's `/dev/shm` is 64 MB by default
(Docker), and a state larger than it dies with SIGBUS on the first touch of the missing pages; a memfd
lives on the kernel's internal tmpfs and is bounded only by memory. On CUDA the arena is page-locked
(`cudaHostRegister`) so device-to-host copies run at full speed, as pinned buffers do.

The arena is reused while the layout (every tensor's path, shape and dtype) stays the same; a new
layout (the first checkpoint, a recipe whose state grows) allocates a new arena, and the writer is
told before its next job.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import time
from dataclasses import dataclass
from typing import Any

import torch

from spotrun.trainer.checkpoint.state import LaterCopies, _map_tensors

log = logging.getLogger(__name__)

ALIGN = 64


@dataclass(frozen=True)
class Slot:
    """Where one tensor of a snapshot lives in the arena: what the writer process rebuilds it from."""

    offset: int
    shape: tuple[int, ...]
    dtype: str  # "float32", "bfloat16", ... (torch.<name>)

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * _dtype(self.dtype).itemsize


def _dtype(name: str) -> torch.dtype:
    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise ValueError(f"not a torch dtype: {name!r}")
    return dt


def view(buf: Any, slot: Slot) -> torch.Tensor:
    """The tensor at `slot` in a mapped arena (shares its memory)."""
    dt = _dtype(slot.dtype)
    count = slot.nbytes // dt.itemsize
    if count == 0:
        return torch.empty(slot.shape, dtype=dt)
    return torch.frombuffer(buf, dtype=dt, count=count, offset=slot.offset).view(slot.shape)


def rebuild(structure: Any, buf: Any) -> Any:
    """Replace every Slot in a snapshot structure by its tensor view of the arena `buf`."""
    if isinstance(structure, Slot):
        return view(buf, structure)
    if isinstance(structure, dict):
        return {k: rebuild(v, buf) for k, v in structure.items()}
    if isinstance(structure, list):
        return [rebuild(v, buf) for v in structure]
    if isinstance(structure, tuple):
        return tuple(rebuild(v, buf) for v in structure)
    return structure


class Arena:
    """One anonymous shared memory file, mapped here; `fd` is what the writer process maps."""

    def __init__(self, size: int, pin: bool = False) -> None:
        self.size = max(size, 1)
        self.fd = os.memfd_create("spotrun-snapshot", os.MFD_CLOEXEC)
        os.ftruncate(self.fd, self.size)
        self.buf = mmap.mmap(self.fd, self.size)
        self.pinned = pin and _pin(self.buf, self.size)

    def close(self) -> None:
        if self.pinned:
            _unpin(self.buf)
        with contextlib.suppress(BufferError):  # a view still alive: the mapping goes with the process
            self.buf.close()
        os.close(self.fd)


class SharedSnapshotter:
    """`state.Snapshotter` into an Arena: `snapshot(state)` copies every tensor into the arena and
    returns the state's structure with a `Slot` where each tensor was (plain values kept)."""

    def __init__(self, pin_memory: bool = False) -> None:
        self.pin_memory = pin_memory
        self.arena: Arena | None = None
        self.generation = 0  # bumped with every new arena: the writer maps the new one first
        self._layout: dict[str, Slot] = {}
        self._views: dict[str, torch.Tensor] = {}
        self._seen = 0  # tensors copied by the snapshot under way
        self.later = LaterCopies()
        self.last_seconds = 0.0

    def snapshot(self, state: Any, later: set[tuple[int, int]] | None = None) -> Any:
        """As `Snapshotter.snapshot`, `later` included."""
        t0 = time.perf_counter()
        # The layout is checked tensor by tensor as they are copied, not computed first: a second walk
        # over the state cost 1.3 ms of a 14 ms snapshot (109 MB, 266 tensors). A tensor with no slot
        # of its shape and dtype, or a count that differs, means a new layout: a new arena, copied again.
        self._seen = 0
        self.later.start(later)
        try:
            if self.arena is None:
                raise _NewLayout
            out = _map_tensors(state, "", self._copy_if_same)  # type: ignore[arg-type]  # tensors become Slots
            if self._seen != len(self._layout):
                raise _NewLayout
        except _NewLayout:
            if self.arena is not None and self.arena.pinned:
                torch.cuda.synchronize()  # copies into the old arena may still run: let them land first
            self._reallocate(_layout_of(state))
            self.later.start(later)  # nothing left for the old arena
            out = _map_tensors(state, "", self._copy)  # type: ignore[arg-type]
        if self.arena is not None and self.arena.pinned:
            torch.cuda.synchronize()  # non_blocking device->host copies must land before the handoff
        self.last_seconds = time.perf_counter() - t0
        return out

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self._layout.values())

    def close(self) -> None:
        self._views.clear()
        if self.arena is not None:
            self.arena.close()
            self.arena = None

    def _reallocate(self, layout: dict[str, Slot]) -> None:
        self.close()
        size = max((s.offset + s.nbytes for s in layout.values()), default=0)
        self.arena = Arena(size, pin=self.pin_memory and torch.cuda.is_available())
        self._layout, self.generation = layout, self.generation + 1
        self._views = {p: view(self.arena.buf, s) for p, s in layout.items()}
        log.debug("snapshot arena %d: %d tensors, %.1f MB", self.generation, len(layout), size / 2**20)

    def _copy(self, path: str, t: torch.Tensor) -> Slot:
        pinned = self.arena is not None and self.arena.pinned
        self.later.copy(self._views[path], t.detach(), non_blocking=pinned)
        return self._layout[path]

    def _copy_if_same(self, path: str, t: torch.Tensor) -> Slot:
        v = self._views.get(path)
        if v is None or v.dtype != t.dtype or v.shape != t.shape:
            raise _NewLayout
        self._seen += 1
        return self._copy(path, t)


class _NewLayout(Exception):
    """The state's tensors no longer fit the arena's layout."""


def _layout_of(state: Any) -> dict[str, Slot]:
    layout: dict[str, Slot] = {}
    offset = 0

    def place(path: str, t: torch.Tensor) -> torch.Tensor:
        nonlocal offset
        slot = Slot(offset, tuple(t.shape), str(t.dtype).removeprefix("torch."))
        layout[path] = slot
        offset += -(-slot.nbytes // ALIGN) * ALIGN
        return t

    _map_tensors(state, "", place)
    return layout


def _pin(buf: mmap.mmap, size: int) -> bool:
    """Page-lock the arena for CUDA copies; False (logged once) where it cannot be."""
    try:
        ptr = torch.frombuffer(buf, dtype=torch.uint8, count=1).data_ptr()
        err = torch.cuda.cudart().cudaHostRegister(ptr, size, 0)
        if int(err) != 0:
            raise RuntimeError(f"cudaHostRegister returned {err}")
        return True
    except Exception as e:  # boundary: an unpinned arena still works, at pageable-copy speed
        log.warning("snapshot arena not page-locked (%s): device copies run slower", e)
        return False


def _unpin(buf: mmap.mmap) -> None:
    with contextlib.suppress(Exception):
        ptr = torch.frombuffer(buf, dtype=torch.uint8, count=1).data_ptr()
        torch.cuda.cudart().cudaHostUnregister(ptr)
