"""docs/integrations.md's Lightning script, exactly as printed, run as a `command:` job through the flow
with three reclaims, one without notice: its final weights and optimizer state equal an uninterrupted
run's tensor by tensor, a notice costs no step, the replayed steps' verdict is exact, and the
documented example differs from Lightning's plain one by at most 5 lines."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from spotrun.trainer.checkpoint.foreign import numpy_allowed
from spotrun.trainer.spec.job import JobSpec
from tests.e2e.test_flow import attempts, reference_dir, run_flow, schedule
from tests.e2e.test_integrations import changed_lines, doc_block, shipped_spec

pytestmark = pytest.mark.slow


def test_the_lightning_example_is_lightnings_plain_script_and_four_lines() -> None:
    plain, ours = doc_block('"""pl_plain.py'), doc_block('"""pl_train.py')
    assert changed_lines(plain.split("\n", 1)[1], ours.split("\n", 1)[1]) <= 5


@pytest.fixture
def pl_job(tmp_path: Path) -> JobSpec:
    return shipped_spec("tiny-mlp-lightning.yaml", tmp_path, tracking={"mlflow": False})


def trained(ckpt: Path) -> dict[str, torch.Tensor]:
    """A Lightning checkpoint's weights and optimizer state, loaded weights-only, as {path: tensor}."""
    with numpy_allowed():
        obj = torch.load(ckpt, map_location="cpu", weights_only=True)
    out: dict[str, torch.Tensor] = {}

    def walk(o: Any, at: str) -> None:
        if isinstance(o, torch.Tensor):
            out[at] = o
        elif isinstance(o, dict):
            for k, v in o.items():
                walk(v, f"{at}/{k}")
        elif isinstance(o, list | tuple):
            for i, v in enumerate(o):
                walk(v, f"{at}/{i}")

    walk({"state_dict": obj["state_dict"], "optimizer_states": obj["optimizer_states"]}, "")
    return out


def assert_trained_equal(a: Path, b: Path) -> None:
    ta, tb = trained(a), trained(b)
    assert ta.keys() == tb.keys()
    unequal = [k for k in ta if not torch.equal(ta[k], tb[k])]
    assert not unequal, unequal


def test_the_lightning_script_survives_three_reclaims_bitwise(
    prefect_api: str, home: Path, tmp_path: Path, pl_job: JobSpec
) -> None:
    # seconds of training after each attempt's first step; a noticed attempt trains on until its
    # replacement stands by (0.5-2 s), at a few ms a step: ~600 of the 1,000 steps in the 3 attempts
    state = run_flow(pl_job, schedule((0.2, True), (0.2, False), (0.2, True), notice_s=10))
    assert state.is_completed(), state.message
    rows = attempts(home)
    assert [r.outcome.value for r in rows] == ["preempted", "preempted", "preempted", "completed"]
    noticed = [r for r in rows[:3] if "without notice" not in r.cause]
    assert len(noticed) == 2 and "without notice" in rows[1].cause
    for r in noticed:  # the callback saved the stop step and spotrun published it: no step lost
        assert r.lost_steps == 0, r
    # the attempt after the reclaim without notice replayed steps whose every loss was reported
    assert rows[2].extra["resume_check"]["verdict"] == "exact", rows[2].extra
    reference = reference_dir(pl_job, tmp_path, timeout=300)
    final = f"epoch={pl_job.total_steps - 1}-step={pl_job.total_steps}.ckpt"
    assert_trained_equal(Path(pl_job.storage) / reference.name / final, reference / final)
