"""Data order and position. Exact resume needs both to be pure functions of (seed, epoch, index).

Measured on CPU with torch 2.13: shuffles from the global RNG, persistent workers, a generator
on the sampler but not on the loader, and worker-RNG augmentation each broke bitwise resume. The
position is (epoch, batches done in the epoch); resume slices the permutation, loading nothing.
"""

from __future__ import annotations

import multiprocessing
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from spotrun.trainer.parent_death import die_with


def sample_generator(seed: int, epoch: int, index: int) -> torch.Generator:
    """A generator seeded by (seed, epoch, index): counter-based augmentation randomness."""
    return torch.Generator().manual_seed((seed * 1_000_003 + epoch * 10_007 + int(index)) % (2**63))


def epoch_generator(seed: int, epoch: int) -> torch.Generator:
    """A generator seeded by (seed, epoch), for a table of per-sample randomness drawn once an epoch
    (row i is sample i's): counter-based like `sample_generator`, in one call instead of one a sample."""
    return torch.Generator().manual_seed((seed * 1_000_003 + epoch * 10_007 + 5_555_555_555) % (2**63))


class EpochSampler(Sampler[int]):
    """Permutation = f(seed, epoch, rank); starts at any offset without loading the skipped samples.

    With world_size > 1 each rank takes a strided share of the same permutation (DistributedSampler's
    layout), so the position stays one (epoch, batches_done) pair for all ranks."""

    def __init__(self, n: int, seed: int, rank: int = 0, world_size: int = 1) -> None:
        self.n, self.seed, self.rank, self.world_size = n, seed, rank, world_size
        self.epoch, self.start = 0, 0

    def set_epoch(self, epoch: int, start: int = 0) -> None:
        self.epoch, self.start = epoch, start

    def _indices(self) -> list[int]:
        g = torch.Generator().manual_seed(self.seed * 7919 + self.epoch)
        perm = torch.randperm(self.n, generator=g).tolist()
        usable = self.n - self.n % self.world_size
        return perm[self.rank : usable : self.world_size]

    def __iter__(self) -> Iterator[int]:
        return iter(self._indices()[self.start :])

    def __len__(self) -> int:
        return self.n // self.world_size - self.start


def _worker_init(_: int) -> None:
    # Leave the trainer's process group: a group-wide SIGTERM (spot notice, Ctrl-C) must reach the
    # trainer only, which finishes the step and checkpoints; the parent still terminates workers.
    os.setpgid(0, 0)
    # Die with the trainer. torch's own watchdog notices a dead parent only if it started while the
    # parent lived: a trainer SIGKILLed right after forking its epoch's workers left them waiting
    # forever on their index queues, holding the trainer's stdout (a test's reader hung on it).
    parent = multiprocessing.parent_process()  # the trainer, as it was when it forked this worker
    die_with(parent.pid if parent is not None and parent.pid is not None else os.getppid(), 1)


@dataclass
class Position:
    epoch: int = 0
    batch: int = 0  # batches done in `epoch`

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "batch": self.batch}

    def load_state_dict(self, sd: dict[str, int]) -> None:
        self.epoch, self.batch = int(sd["epoch"]), int(sd["batch"])

    def skip(self, steps: int, per_epoch: int, k: int = 1) -> None:
        """Pass over the data of `steps` steps of `k` batches, as the trainer's stream would draw them
        (an epoch's short last group is dropped)."""
        for _ in range(steps):
            if per_epoch - self.batch < k:
                self.epoch, self.batch = self.epoch + 1, 0
            self.batch += k


class ResumableLoader:
    """Yields batches forever from (epoch, batch) on, advancing its Position as batches are consumed."""

    def __init__(
        self,
        dataset: Dataset[Any],
        batch_size: int,
        seed: int,
        *,
        num_workers: int,
        rank: int = 0,
        world: int = 1,
    ) -> None:
        self.dataset, self.batch_size = dataset, batch_size
        self.sampler = EpochSampler(len(dataset), seed, rank, world)  # type: ignore[arg-type]
        self.position = Position()
        # Non-persistent workers: each epoch's workers are forked after set_epoch and see it.
        # The loader's own generator keeps worker base_seed off the global RNG.
        self.loader = DataLoader(
            dataset,
            batch_size=batch_size,
            sampler=self.sampler,
            num_workers=num_workers,
            worker_init_fn=_worker_init if num_workers else None,
            generator=torch.Generator().manual_seed(seed),
            drop_last=True,
        )
        if len(self.sampler) < batch_size:
            raise ValueError(f"dataset of {len(self.sampler)} samples per rank is smaller than one batch")

    def batches_per_epoch(self) -> int:
        return (self.sampler.n // self.sampler.world_size) // self.batch_size

    def epoch_iter(self) -> Iterator[Any]:
        """Iterate the rest of the current epoch; the caller restores global RNG after this is created."""
        pos = self.position
        if pos.batch >= self.batches_per_epoch():
            pos.epoch, pos.batch = pos.epoch + 1, 0
        set_epoch = getattr(self.dataset, "set_epoch", None)
        if callable(set_epoch):
            set_epoch(pos.epoch)
        self.sampler.set_epoch(pos.epoch, start=pos.batch * self.batch_size)
        return iter(self.loader)
