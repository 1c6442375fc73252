"""In-process attempts: --max-steps chains, --resume-from (rollback and fork), AMP scaler state."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.trainer_runs import assert_states_equal
from trainer.ckpt_format import COMPLETED, step_dir
from trainer.errors import ConfigError
from trainer.exitcodes import ExitCode
from trainer.loop import AttemptOptions, ResumeSource, run_attempt
from trainer.spec import JobSpec
from trainer.storage import LocalStorage

SPEC: dict[str, Any] = {
    "name": "opts",
    "recipe": "digits",
    "args": {"hidden": 32},
    "total_steps": 30,
    "threads": 1,
    "checkpoint": {"every_steps": 10, "keep": 3},
}


def _run(spec: dict[str, Any], store: Path, cache: Path, **kw: Any) -> Any:
    return run_attempt(JobSpec.model_validate(spec), LocalStorage(store), AttemptOptions(cache=cache, **kw))


@pytest.mark.parametrize("amp", [False, True])
def test_max_steps_chain_equals_one_run(tmp_path: Path, amp: bool) -> None:
    spec = {**SPEC, "amp": amp}
    full = _run(spec, tmp_path / "full", tmp_path / "c1")
    assert full.code is ExitCode.COMPLETED
    codes = []
    for _ in range(3):  # 13 + 13 + 4 steps; each stop writes a checkpoint at its step
        part = _run(spec, tmp_path / "parts", tmp_path / "c2", max_steps=13)
        codes.append(part.code)
    assert codes == [ExitCode.STOPPED, ExitCode.STOPPED, ExitCode.COMPLETED] and part.resumed_from == 26
    assert_states_equal(tmp_path / "full" / step_dir(30), tmp_path / "parts" / step_dir(30))
    if amp:
        assert (tmp_path / "parts" / step_dir(30) / "scaler.pt").is_file()


def test_completed_job_is_not_retrained(tmp_path: Path) -> None:
    _run(SPEC, tmp_path / "s", tmp_path / "c")
    assert (tmp_path / "s" / COMPLETED).is_file()
    again = _run(SPEC, tmp_path / "s", tmp_path / "c")
    assert again.code is ExitCode.COMPLETED and again.message == "already completed"


def test_resume_from_an_older_step_in_the_same_storage_is_refused(tmp_path: Path) -> None:
    _run(SPEC, tmp_path / "s", tmp_path / "c", max_steps=25)
    with pytest.raises(ConfigError, match=r"holds newer checkpoints \[20, 25\]"):
        _run(SPEC, tmp_path / "s", tmp_path / "c", resume_from=ResumeSource(10))


def test_resume_from_a_missing_step_names_it(tmp_path: Path) -> None:
    _run(SPEC, tmp_path / "s", tmp_path / "c", max_steps=25)
    with pytest.raises(ConfigError, match=r"step 15 of .* is not usable"):
        _run(SPEC, tmp_path / "s", tmp_path / "c", resume_from=ResumeSource(15))


def test_fork_from_another_storage_continues_exactly(tmp_path: Path) -> None:
    _run(SPEC, tmp_path / "full", tmp_path / "c0")
    _run(SPEC, tmp_path / "old", tmp_path / "c1", max_steps=25)
    forked = _run(
        SPEC, tmp_path / "new", tmp_path / "c2", resume_from=ResumeSource(20, LocalStorage(tmp_path / "old"))
    )
    assert (forked.code, forked.resumed_from) == (ExitCode.COMPLETED, 20)
    assert_states_equal(tmp_path / "full" / step_dir(30), tmp_path / "new" / step_dir(30))
    assert (tmp_path / "old" / step_dir(25)).is_dir()  # the source is untouched


def test_time_based_checkpoints_and_retention(tmp_path: Path) -> None:
    spec = {**SPEC, "checkpoint": {"every_steps": None, "every_seconds": 0.001, "keep": 2}}
    result = _run(spec, tmp_path / "s", tmp_path / "c")
    assert result.code is ExitCode.COMPLETED
    steps = sorted(
        int(p.parent.name.removeprefix("step_")) for p in (tmp_path / "s").glob("step_*/manifest.json")
    )
    assert steps[-1] == 30 and len(steps) == 2  # a checkpoint after (nearly) every step; retention keeps 2
