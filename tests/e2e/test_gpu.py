"""GPU checks: CUDA RNG restore and pinned snapshot buffers. Skipped where no CUDA device exists."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.trainer_runs import assert_states_equal
from trainer.ckpt_format import step_dir
from trainer.loop import AttemptOptions, run_attempt
from trainer.spec import JobSpec
from trainer.state import Snapshotter, capture_rng, restore_rng
from trainer.storage import LocalStorage

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
        {"name": "gpu", "recipe": "digits", "total_steps": 40, "device": "cuda", "amp": amp,
         "checkpoint": {"every_steps": 10, "keep": 2}}
    )  # fmt: skip
    torch.use_deterministic_algorithms(True, warn_only=True)
    run_attempt(spec, LocalStorage(tmp_path / "full"), AttemptOptions(cache=tmp_path / "c1"))
    for _ in range(3):
        run_attempt(
            spec, LocalStorage(tmp_path / "parts"), AttemptOptions(cache=tmp_path / "c2", max_steps=15)
        )
    assert_states_equal(tmp_path / "full" / step_dir(40), tmp_path / "parts" / step_dir(40))
