"""GPU checks: CUDA RNG restore and pinned snapshot buffers. Skipped where no CUDA device exists."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from spotrun.trainer.checkpoint.format import step_dir
from spotrun.trainer.checkpoint.state import Snapshotter, capture_rng, restore_rng
from spotrun.trainer.session.loop import AttemptOptions, run_attempt
from spotrun.trainer.spec.job import JobSpec
from spotrun.trainer.storage import LocalStorage
from tests.trainer_runs import assert_states_equal

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device; none is visible here"),
]


def test_cuda_rng_round_trip() -> None:
    dev = torch.device("cuda")
    torch.cuda.manual_seed_all(5)
    state = capture_rng(dev)
    expected = torch.rand(4, device=dev)
    torch.rand(100, device=dev)
    restore_rng(state, dev)
    assert torch.equal(torch.rand(4, device=dev), expected)


def test_pinned_snapshot_copies_device_tensors() -> None:
    snap = Snapshotter(pin_memory=True)
    w = torch.arange(1 << 20, device="cuda", dtype=torch.float32)
    out = snap.snapshot({"w": w})
    w.zero_()
    assert out["w"].is_pinned() and out["w"].device.type == "cpu"
    assert torch.equal(out["w"], torch.arange(1 << 20, dtype=torch.float32))


@pytest.mark.parametrize("amp", [False, True])
def test_resume_on_cuda_is_exact(tmp_path: Path, amp: bool) -> None:
    spec = JobSpec.model_validate(
        {
            "name": "gpu",
            "recipe": "digits",
            "total_steps": 40,
            "device": "cuda",
            "amp": amp,
            "checkpoint": {"every_steps": 10, "keep": 2},
        }
    )
    torch.use_deterministic_algorithms(True, warn_only=True)
    run_attempt(spec, LocalStorage(tmp_path / "full"), AttemptOptions(cache=tmp_path / "c1"))
    for _ in range(3):
        run_attempt(
            spec, LocalStorage(tmp_path / "parts"), AttemptOptions(cache=tmp_path / "c2", max_steps=15)
        )
    assert_states_equal(tmp_path / "full" / step_dir(40), tmp_path / "parts" / step_dir(40))


def test_one_rank_nccl_dcp_async_pinned_resume_is_exact(tmp_path: Path) -> None:
    """One NCCL rank, DCP async_save staging into pinned host memory: killed and resumed, bitwise equal
    to an uninterrupted run. The stage (the loop's stall) per GB is printed from the trainer's log."""
    import json
    import re

    from tests.trainer_runs import assert_sharded_equal, losses, trainer

    spec = {
        "name": "gpu-dcp",
        "recipe": "charlm",
        "device": "cuda",
        "total_steps": 40,
        "threads": 1,
        "seed": 2,
        "args": {"d_model": 256, "n_layers": 4, "seq_len": 64, "max_corpus_mb": 0.5},
        "batch_size": 8,
        "checkpoint": {"every_steps": 10, "keep": 2},
        "distributed": {"nproc_per_node": 1, "strategy": "ddp", "backend": "nccl"},
    }
    cfg = tmp_path / "job.yaml"
    cfg.write_text(json.dumps(spec))
    full, parts = tmp_path / "full", tmp_path / "parts"
    full.mkdir()
    parts.mkdir()
    r = trainer(cfg, str(full / "store"), full)
    assert r.returncode == 0, r.stderr[-3000:]
    r = trainer(cfg, str(parts / "store"), parts, "--inject-fault", "sigkill@25")
    assert r.returncode != 0
    r = trainer(cfg, str(parts / "store"), parts)
    assert r.returncode == 0 and "resuming from step 20" in r.stderr, r.stderr[-3000:]
    assert losses(parts) == losses(full)
    assert_sharded_equal(full / "store" / step_dir(40), parts / "store" / step_dir(40), tmp_path)
    stages = [float(s) for s in re.findall(r"stage ([0-9.]+)s", r.stderr)]
    size = sum(p.stat().st_size for p in (parts / "store" / step_dir(40)).iterdir())
    print(f"DCP async stage on CUDA: {min(stages):.4f}-{max(stages):.4f} s for {size / 1e9:.3f} GB")
