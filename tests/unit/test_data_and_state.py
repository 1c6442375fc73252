"""Data position and state capture: the pieces bitwise resume rests on, tested in-process."""

from __future__ import annotations

import io
import os
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import Dataset

from spotrun.trainer.checkpoint.state import Snapshotter, capture_rng, host_copy, restore_rng
from spotrun.trainer.recipes.data import EpochSampler, ResumableLoader, sample_generator
from spotrun.trainer.saving.shm import SharedSnapshotter, rebuild
from tests.procs import wait_gone


class Noisy(Dataset[torch.Tensor]):
    def __init__(self, n: int) -> None:
        self.n, self.epoch = n, 0

    def set_epoch(self, e: int) -> None:
        self.epoch = e

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor([float(i)]) + torch.randn(1, generator=sample_generator(3, self.epoch, i))


def _stream(loader: ResumableLoader, n: int) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []
    while len(out) < n:
        for b in loader.epoch_iter():
            out.append(b)
            loader.position.batch += 1
            if len(out) == n:
                return out
        loader.position.epoch, loader.position.batch = loader.position.epoch + 1, 0
    return out


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("batch_size", [4, 7])
@pytest.mark.parametrize("stop", [1, 5, 10, 13])
def test_loader_resumes_mid_stream(num_workers: int, batch_size: int, stop: int) -> None:
    """Checkpoint the position mid-stream, resume with a fresh loader: the same stream, exactly."""
    n = 3 * (50 // batch_size)
    full = _stream(ResumableLoader(Noisy(50), batch_size, 11, num_workers=0), n)
    first = ResumableLoader(Noisy(50), batch_size, 11, num_workers=num_workers)
    head = _stream(first, stop)
    saved = first.position.state_dict()
    second = ResumableLoader(Noisy(50), batch_size, 11, num_workers=num_workers)
    second.position.load_state_dict(saved)
    tail = _stream(second, n - stop)
    assert len(head + tail) == len(full)
    assert all(torch.equal(a, b) for a, b in zip(head + tail, full, strict=True))


def test_sampler_is_a_function_of_seed_and_epoch_and_shards_by_rank() -> None:
    s = EpochSampler(10, seed=1)
    s.set_epoch(2)
    order = list(s)
    s.set_epoch(2, start=4)
    assert list(s) == order[4:]
    s.set_epoch(3)
    assert list(s) != order
    ranks = [EpochSampler(10, 1, r, 2) for r in (0, 1)]
    for r in ranks:
        r.set_epoch(2)
    assert sorted(list(ranks[0]) + list(ranks[1])) == sorted(order)


def test_rng_round_trip_is_weights_only_safe() -> None:
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    state = capture_rng(torch.device("cpu"))
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=True)
    expected = (random.random(), np.random.rand(), torch.rand(1))
    restore_rng(loaded, torch.device("cpu"))
    assert (random.random(), np.random.rand()) == expected[:2]
    assert torch.equal(torch.rand(1), expected[2])


def test_snapshot_is_a_copy_into_reused_buffers() -> None:
    snap = Snapshotter()
    w = torch.ones(3)
    state = {"model": {"w": w}, "meta": {"step": 1, "list": [torch.zeros(2)]}}
    first = snap.snapshot(state)
    w.add_(1)  # training goes on while the writer thread holds the snapshot
    assert torch.equal(first["model"]["w"], torch.ones(3))
    second = snap.snapshot(state)
    assert second["model"]["w"].data_ptr() == first["model"]["w"].data_ptr()
    assert torch.equal(second["model"]["w"], torch.full((3,), 2.0))
    assert second["meta"]["step"] == 1 and snap.nbytes == 5 * 4


SOURCES = {
    "contiguous float32": lambda: torch.arange(12.0).reshape(3, 4),
    "bfloat16": lambda: torch.arange(12.0).to(torch.bfloat16).reshape(3, 4),
    "int64 step counter": lambda: torch.tensor(7),
    "empty": lambda: torch.empty(0, 4),
    "transposed view (strided)": lambda: torch.arange(12.0).reshape(4, 3).t(),
    "offset view": lambda: torch.arange(20.0)[4:16].reshape(3, 4),
    "parameter": lambda: torch.nn.Parameter(torch.arange(12.0).reshape(3, 4)).detach(),
    "lazy conjugate": lambda: torch.complex(torch.arange(6.0), torch.ones(6)).conj(),
}


@pytest.mark.parametrize("name", SOURCES)
def test_host_copy_equals_copy_for_every_kind_of_source(name: str) -> None:
    src = SOURCES[name]()
    dst = torch.full(src.shape, -1, dtype=src.dtype)
    host_copy(dst, src)
    assert torch.equal(dst, src.resolve_neg().resolve_conj())


def test_the_arena_takes_a_new_layout_when_the_state_changes_shape() -> None:
    """The layout is checked as the tensors are copied: a new, a missing or a resized tensor moves the
    snapshot to a new arena, with every value right."""
    snap = SharedSnapshotter()
    try:
        states = [
            {"w": torch.ones(3), "opt": [torch.zeros(2)]},
            {"w": torch.full((3,), 2.0), "opt": [torch.ones(2)]},  # same layout: same arena
            {"w": torch.full((4,), 3.0), "opt": [torch.ones(2)]},  # resized
            {"w": torch.full((4,), 4.0), "opt": [torch.ones(2), torch.ones(1)]},  # grown
            {"w": torch.full((4,), 5.0), "opt": []},  # shrunk
        ]
        generations = []
        for state in states:
            out = rebuild(snap.snapshot(state), snap.arena.buf if snap.arena else None)
            generations.append(snap.generation)
            assert torch.equal(out["w"], state["w"]) and len(out["opt"]) == len(state["opt"])
            assert all(torch.equal(a, b) for a, b in zip(out["opt"], state["opt"], strict=True))
        assert generations == [1, 1, 2, 3, 4]
    finally:
        snap.close()


def test_the_model_file_is_the_same_bytes_in_every_process(tmp_path: Path) -> None:
    """safetensors orders several metadata keys per process; the one key spotrun writes cannot move."""
    code = (
        "import sys, torch; from pathlib import Path;"
        "from spotrun.trainer.checkpoint.format import write_part;"
        "from spotrun.trainer.checkpoint.stateful import Codec;"
        "sd = {'b': torch.ones(2), 'a': torch.arange(6.).reshape(2, 3),"
        " 'h': torch.zeros(1, dtype=torch.float16)};"
        "print(write_part(Path(sys.argv[1]), Codec.SAFETENSORS, sd, step=1200).digest)"
    )
    digests = set()
    for seed in range(6):
        out = tmp_path / f"m{seed}.safetensors"
        env = {**os.environ, "PYTHONHASHSEED": str(seed), "PYTHONPATH": str(Path(__file__).parents[2])}
        r = subprocess.run([sys.executable, "-c", code, str(out)], env=env, capture_output=True, text=True)
        assert r.returncode == 0, r.stderr[-2000:]
        digests.add(r.stdout.strip())
    assert len(digests) == 1, digests
    from safetensors import safe_open

    from spotrun.trainer.checkpoint.format import metadata_step

    with safe_open(str(tmp_path / "m0.safetensors"), framework="pt") as f:
        assert metadata_step(f.metadata()) == 1200
    assert metadata_step({"format": "spotrun/1", "step": "30"}) == 30  # files written before
    assert metadata_step({"spotrun": "not json"}) is None and metadata_step(None) is None


ORPHAN = """
import multiprocessing, os, sys, time
from spotrun.trainer.recipes.data import _worker_init

def worker():
    time.sleep(0.5)  # the parent dies before this worker's start-up runs
    _worker_init(0)
    time.sleep(60)

if __name__ == "__main__":
    p = multiprocessing.get_context("fork").Process(target=worker)
    p.start()
    print(p.pid, flush=True)
    os._exit(0)
"""


def test_a_data_worker_whose_trainer_died_before_it_started_exits() -> None:
    """torch's watchdog takes the parent it sees at start for the trainer: a worker orphaned before that
    would wait forever (it held a test's pipe open for 5 minutes). _worker_init ends it."""
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])}
    r = subprocess.run([sys.executable, "-c", ORPHAN], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    pid = int(r.stdout.split()[0])
    assert wait_gone(pid, timeout=20), f"data worker {pid} outlived its trainer"
