"""`s.batches(dataset, micro_batches=K)`: K batches per optimizer step, the position K batches a step, an
epoch's short group dropped, a resume anywhere the same stream as no resume, bad K refused in one line
(loops: tests/fakes/session_loops.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from spotrun.trainer.errors import ConfigError
from spotrun.trainer.exitcodes import ExitCode
from spotrun.trainer.recipes.data import EpochSampler
from spotrun.trainer.session.loop import AttemptOptions, run_attempt
from spotrun.trainer.session.options import AttemptResult
from spotrun.trainer.spec.job import JobSpec
from spotrun.trainer.storage import LocalStorage
from tests.fakes import session_loops

SEED = 3


def attempt(
    store: Path, loop: str, max_steps: int | None = None, **spec: Any
) -> tuple[AttemptResult, list[list[list[int]]]]:
    """One attempt of `loop` on `store`, and the steps it saw (accumulate's micro-batches)."""
    job = {
        "name": "micro",
        "entrypoint": f"tests.fakes.session_loops:{loop}",
        "total_steps": 8,
        "batch_size": 1,
        "seed": SEED,
        "threads": 1,
        "checkpoint": {"every_steps": 100, "keep": 2},
        "tracking": {"mlflow": False},
        **spec,
    }
    opts = AttemptOptions(cache=store.parent / f"cache-{store.name}", max_steps=max_steps)
    session_loops.SEEN.clear()
    result = run_attempt(JobSpec.model_validate(job), LocalStorage(store), opts)
    return result, list(session_loops.SEEN)


def expected(samples: int, batch_size: int, k: int, steps: int) -> list[list[list[int]]]:
    """The steps as the trainer's permutation per epoch makes them: batches of `batch_size` (the last
    partial one dropped), grouped K to a step, an epoch's short group dropped."""
    out: list[list[list[int]]] = []
    epoch = 0
    while len(out) < steps:
        sampler = EpochSampler(samples, SEED)
        sampler.set_epoch(epoch)
        order = list(sampler)
        batches = [order[i : i + batch_size] for i in range(0, samples - batch_size + 1, batch_size)]
        out += [batches[i : i + k] for i in range(0, len(batches) - k + 1, k)]
        epoch += 1
    return out[:steps]


@pytest.mark.parametrize(
    ("samples", "batch_size", "k", "steps"),
    [
        (12, 1, 1, 15),  # K = 1: a batch a step, as without micro_batches
        (10, 1, 3, 7),  # 10 batches an epoch: 3 steps, the 10th batch dropped, 3 epochs
        (16, 2, 2, 6),  # 8 batches of 2 an epoch: 4 steps, nothing dropped
        (7, 2, 3, 4),  # 3 batches of 2 (a sample dropped): 1 step an epoch
        (9, 1, 9, 3),  # K = every batch of the epoch
    ],
)
def test_steps_group_k_batches_and_drop_an_epochs_short_group(
    tmp_path: Path, samples: int, batch_size: int, k: int, steps: int
) -> None:
    args = {"samples": samples, "micro_batches": k}
    result, seen = attempt(
        tmp_path / "store", "accumulate", total_steps=steps, batch_size=batch_size, args=args
    )
    assert (result.code, result.step) == (ExitCode.COMPLETED, steps)
    assert seen == expected(samples, batch_size, k, steps)
    assert all(len(step) == k and all(len(b) == batch_size for b in step) for step in seen)


@pytest.mark.parametrize(
    "stop_at",
    [
        1,  # mid-epoch: position (0, 3)
        3,  # the epoch's last full step: position (0, 9), the short group left behind
        4,  # the next epoch's first step
        6,  # the end of the second epoch
    ],
)
def test_a_resume_continues_the_same_micro_batches_as_no_resume(tmp_path: Path, stop_at: int) -> None:
    job: dict[str, Any] = {"total_steps": 8, "args": {"samples": 10, "micro_batches": 3}}
    _, reference = attempt(tmp_path / "reference", "accumulate", **job)
    first, before = attempt(tmp_path / "store", "accumulate", max_steps=stop_at, **job)
    assert (first.code, first.durable_step) == (ExitCode.STOPPED, stop_at)
    second, after = attempt(tmp_path / "store", "accumulate", **job)
    assert (second.code, second.resumed_from, second.step) == (ExitCode.COMPLETED, stop_at, 8)
    assert before + after == reference == expected(10, 1, 3, 8)


def test_a_checkpoint_of_another_k_resumes_at_its_first_unused_batch(tmp_path: Path) -> None:
    """The position counts batches: K = 2 for 2 steps used batches 0-3 of epoch 0; K = 3 goes on at 4."""
    job: dict[str, Any] = {"total_steps": 6, "shape_args": [], "resume": {"allow_changes": True}}
    attempt(tmp_path / "store", "accumulate", max_steps=2, args={"samples": 10, "micro_batches": 2}, **job)
    result, after = attempt(tmp_path / "store", "accumulate", args={"samples": 10, "micro_batches": 3}, **job)
    assert (result.code, result.resumed_from) == (ExitCode.COMPLETED, 2)
    epoch_0 = [b for step in expected(10, 1, 1, 10) for b in step]
    epoch_1 = [b for step in expected(10, 1, 1, 20)[10:] for b in step]
    assert after == [epoch_0[4:7], epoch_0[7:10], epoch_1[0:3], epoch_1[3:6]]


@pytest.mark.parametrize(
    ("k", "message"),
    [
        (0, r"batches\(micro_batches=0\) is below 1; pass 1 \(no accumulation\) or more"),
        (-2, r"batches\(micro_batches=-2\) is below 1"),
        (2.5, r"batches\(micro_batches=2.5\) is not an int; pass a whole number of batches per step"),
        ("4", r"batches\(micro_batches='4'\) is not an int"),
        (True, r"batches\(micro_batches=True\) is not an int"),
        (
            65,
            r"batches\(micro_batches=65\) is more than the 64 batches of 1 in an epoch, .*; lower micro",
        ),
    ],
)
def test_bad_micro_batches_are_refused_in_one_line(tmp_path: Path, k: Any, message: str) -> None:
    with pytest.raises(ConfigError, match=message) as e:
        attempt(tmp_path / "store", "micro_batches", args={"k": k})
    assert "\n" not in str(e.value)
