"""In-process attempts: --max-steps chains, --resume-from (rollback and fork), AMP scaler state."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import pytest

from spotrun.trainer.checkpoint.format import COMPLETED, load_part, step_dir
from spotrun.trainer.errors import ConfigError, ResumeIncompatible
from spotrun.trainer.exitcodes import ExitCode
from spotrun.trainer.session.loop import AttemptOptions, ResumeSource, run_attempt
from spotrun.trainer.spec.job import JobSpec
from spotrun.trainer.storage import LocalStorage
from spotrun.trainer.telemetry.status import StatusReporter, parse_status_line
from tests.trainer_runs import assert_states_equal

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


def _started(stream: io.StringIO) -> dict[str, Any]:
    records = [r.to_json() for line in stream.getvalue().splitlines() if (r := parse_status_line(line))]
    return next(r for r in records if r["kind"] == "started")


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"args": {"hidden": 32, "lr": 0.001}}, "args.lr (unset) -> 0.001"),
        ({"args": {"hidden": 32, "dropout": 0.0}}, "args.dropout (unset) -> 0.0"),
        ({"seed": 5}, "seed 0 -> 5"),
        ({"batch_size": 32}, "batch_size 64 -> 32"),
    ],
)
def test_a_trajectory_change_is_refused_by_name_and_deletes_nothing(
    tmp_path: Path, change: dict[str, Any], named: str
) -> None:
    _run(SPEC, tmp_path / "s", tmp_path / "c", max_steps=20)
    before = sorted(p.name for p in (tmp_path / "s").iterdir())
    with pytest.raises(ResumeIncompatible) as e:
        _run({**SPEC, **change}, tmp_path / "s", tmp_path / "c")
    assert named in str(e.value) and "--allow-changes" in str(e.value) and "\n" not in str(e.value)
    assert sorted(p.name for p in (tmp_path / "s").iterdir()) == before


def test_a_shape_change_is_refused_by_name_even_when_changes_are_allowed(tmp_path: Path) -> None:
    _run(SPEC, tmp_path / "s", tmp_path / "c", max_steps=20)
    changed = {**SPEC, "args": {"hidden": 48, "lr": 0.001}, "resume": {"allow_changes": True}}
    with pytest.raises(ResumeIncompatible, match=r"different shape settings \(args\.hidden 32 -> 48\)"):
        _run(changed, tmp_path / "s", tmp_path / "c")


def test_an_allowed_change_is_recorded_reported_and_needed_only_once(tmp_path: Path) -> None:
    _run(SPEC, tmp_path / "s", tmp_path / "c", max_steps=20)
    changed = {**SPEC, "seed": 3, "args": {"hidden": 32, "lr": 0.001}}
    stream = io.StringIO()
    result = _run(
        {**changed, "resume": {"allow_changes": True}},
        tmp_path / "s",
        tmp_path / "c",
        max_steps=5,
        reporter=StatusReporter(stream),
    )
    assert (result.resumed_from, result.step) == (20, 25)
    assert _started(stream)["changes"] == [
        {"field": "args.lr", "old": "(unset)", "new": "0.001"},
        {"field": "seed", "old": "0", "new": "3"},
    ]
    meta = load_part(tmp_path / "s" / step_dir(25) / "trainer.pt")["state"]
    assert [(c["step"], c["field"]) for c in meta["changes"]] == [(20, "args.lr"), (20, "seed")]
    stream = io.StringIO()
    again = _run(changed, tmp_path / "s", tmp_path / "c", reporter=StatusReporter(stream))
    assert again.code is ExitCode.COMPLETED and "changes" not in _started(stream)  # its own settings now
    final = load_part(tmp_path / "s" / step_dir(30) / "trainer.pt")["state"]
    assert final["changes"] == meta["changes"]  # the history travels on


def test_fork_into_a_new_store_with_a_new_learning_rate(tmp_path: Path) -> None:
    _run(SPEC, tmp_path / "old", tmp_path / "c1", max_steps=20)
    changed = {**SPEC, "args": {"hidden": 32, "lr": 0.001}}
    source = ResumeSource(20, LocalStorage(tmp_path / "old"))
    with pytest.raises(ResumeIncompatible, match=r"args\.lr \(unset\) -> 0\.001"):
        _run(changed, tmp_path / "new", tmp_path / "c2", resume_from=source)
    forked = _run(
        {**changed, "resume": {"allow_changes": True}}, tmp_path / "new", tmp_path / "c2", resume_from=source
    )
    assert (forked.code, forked.resumed_from, [c.field for c in forked.changes]) == (
        ExitCode.COMPLETED,
        20,
        ["args.lr"],
    )
