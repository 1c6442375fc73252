"""spotrun.session's one-line refusals and its endings, in process (loops: tests/fakes/session_loops.py)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest

import spotrun
from spotrun.trainer.checkpoint.completion import completed_step
from spotrun.trainer.errors import ConfigError, TrainingDiverged
from spotrun.trainer.exitcodes import ExitCode
from spotrun.trainer.session.loop import AttemptOptions, run_attempt
from spotrun.trainer.session.options import AttemptResult
from spotrun.trainer.spec.job import JobSpec
from spotrun.trainer.storage import LocalStorage


def attempt(tmp_path: Path, loop: str, **spec: Any) -> AttemptResult:
    job = {
        "name": "own",
        "entrypoint": f"tests.fakes.session_loops:{loop}",
        "total_steps": 20,
        "batch_size": 1,
        "threads": 1,
        "checkpoint": {"every_steps": 5, "keep": 2},
        "tracking": {"mlflow": False},
        **spec,
    }
    store = LocalStorage(tmp_path / "store")
    return run_attempt(JobSpec.model_validate(job), store, AttemptOptions(cache=tmp_path / "cache"))


def test_outside_a_job_it_says_how_to_run_it() -> None:
    with pytest.raises(ConfigError, match=r"runs inside a spotrun job: name this function in a job file"):
        spotrun.session(model=None, optimizer=None)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("loop", "message"),
    [
        ("no_session", "returned without finishing spotrun.session"),
        ("wrong_batch_size", r"batches\(batch_size=3\) differs from the job's batch_size 1"),
        ("reserved_extra", "extra part 'rng' is a name spotrun uses itself; rename it"),
    ],
)
def test_refusals_are_one_line(tmp_path: Path, loop: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message) as e:
        attempt(tmp_path, loop)
    assert "\n" not in str(e.value)


def test_finish_ends_the_job_early_as_completed(tmp_path: Path) -> None:
    result = attempt(tmp_path, "early_stop", args={"stop_at": 7})
    assert (result.code, result.step, result.durable_step) == (ExitCode.COMPLETED, 7, 7)
    assert completed_step(LocalStorage(tmp_path / "store")) == 7


def test_a_non_finite_loss_stops_before_any_checkpoint_of_it(tmp_path: Path) -> None:
    with pytest.raises(TrainingDiverged, match="loss is nan at step 3"):
        attempt(tmp_path, "diverges")
    assert sorted(p.name for p in (tmp_path / "store").glob("step_*")) == []  # every 5 steps: none yet


def test_attempt_options_are_frozen_once_built(tmp_path: Path) -> None:
    opts = AttemptOptions(cache=tmp_path / "cache")
    with pytest.raises(dataclasses.FrozenInstanceError):
        opts.max_steps = 3  # type: ignore[misc]


def test_an_evaluation_in_a_section_is_reported_around_no_step(tmp_path: Path) -> None:
    records: list[Any] = []
    opts = AttemptOptions(cache=tmp_path / "cache")
    opts.reporter.subscribe(records.append)
    job = JobSpec.model_validate(
        {
            "name": "own",
            "entrypoint": "tests.fakes.session_loops:evaluates",
            "total_steps": 10,
            "batch_size": 1,
            "threads": 1,
            "tracking": {"mlflow": False},
        }
    )
    result = run_attempt(job, LocalStorage(tmp_path / "store"), opts)
    assert result.code == ExitCode.COMPLETED
    sections = [(r.name, r.begin, r.step) for r in records if r.kind == "section"]
    assert sections == [("eval", True, 5), ("eval", False, 5), ("eval", True, 10), ("eval", False, 10)]
