"""A recipe's `extra_state` (an EMA of the weights, a call counter) rides in every checkpoint: saved,
validated, restored, and equal to the uninterrupted run's after a resume. A part the checkpoint
lacks, or holds without the job registering it, is refused with its name."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from spotrun.trainer.checkpoint.format import MANIFEST, FileEntry, Manifest, load_part, step_dir
from spotrun.trainer.checkpoint.state import RngState
from spotrun.trainer.checkpoint.stateful import Expectation, Registry
from spotrun.trainer.checkpoint.validate import validate_dir
from spotrun.trainer.errors import ResumeIncompatible
from spotrun.trainer.exitcodes import ExitCode
from spotrun.trainer.recipes import RecipeContext
from spotrun.trainer.session.loop import AttemptOptions, run_attempt
from spotrun.trainer.session.resume import load_state
from spotrun.trainer.spec.job import JobSpec
from spotrun.trainer.storage import LocalStorage
from spotrun.trainer.storage.digests import digest_file
from tests.fakes import extra_recipe

SPEC: dict[str, Any] = {
    "name": "extra",
    "recipe": "tests.fakes.extra_recipe:build",
    "args": {"hidden": 16},
    "total_steps": 20,
    "threads": 1,
    "checkpoint": {"every_steps": 10, "keep": 3},
}


def _run(store: Path, cache: Path, **kw: Any) -> Any:
    return run_attempt(JobSpec.model_validate(SPEC), LocalStorage(store), AttemptOptions(cache=cache, **kw))


def _extra(d: Path, name: str) -> Any:
    return load_part(d / f"extra.{name}.pt")["state"]


def _registry(extra: set[str]) -> Registry:
    """The registry a job whose recipe returns the `extra` parts (any beyond ema and calls: counters)."""
    parts = extra_recipe.build(SPEC["args"], RecipeContext(0, 20, 64, torch.device("cpu")))
    more = {k: parts.extra_state.get(k) or extra_recipe.Calls() for k in sorted(extra)}
    held = {"model": parts.model, "optimizer": parts.optimizer, "scheduler": parts.scheduler}
    return Registry(0, held | {"rng": RngState(torch.device("cpu")), "trainer": extra_recipe.Calls()}, more)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`full`: 20 steps in one attempt; `parts`: 13 steps, then a resume for the last 7."""
    root = tmp_path_factory.mktemp("extra")
    assert _run(root / "full", root / "c1").code is ExitCode.COMPLETED
    assert _run(root / "parts", root / "c2", max_steps=13).code is ExitCode.STOPPED
    resumed = _run(root / "parts", root / "c2")
    assert resumed.code is ExitCode.COMPLETED and resumed.resumed_from == 13
    return root


def test_extra_state_is_saved_validated_and_equal_after_a_resume(runs: Path) -> None:
    full, parts = runs / "full" / step_dir(20), runs / "parts" / step_dir(20)
    assert _extra(parts, "calls") == _extra(full, "calls") == {"n": 20}  # restored, not restarted
    ema_full, ema_parts = _extra(full, "ema"), _extra(parts, "ema")
    assert ema_full["shadow"].keys() == ema_parts["shadow"].keys()
    for k, t in ema_full["shadow"].items():
        assert torch.equal(t, ema_parts["shadow"][k]), f"EMA of {k} differs"
    shape_hash = JobSpec.model_validate(SPEC).shape_hash()
    assert validate_dir(parts, Expectation.from_registry(_registry(extra_recipe.EXTRA), shape_hash)) == []


def test_a_nan_in_extra_state_is_found_in_its_file(runs: Path, tmp_path: Path) -> None:
    d, bad = runs / "parts" / step_dir(20), tmp_path / step_dir(20)
    bad.mkdir()
    for f in d.iterdir():
        (bad / f.name).write_bytes(f.read_bytes())
    obj = load_part(bad / "extra.ema.pt")
    obj["state"]["shadow"]["0.weight"].view(-1)[0] = float("nan")
    torch.save(obj, bad / "extra.ema.pt")
    m = Manifest.from_json((bad / MANIFEST).read_bytes())  # rehashed: integrity passes, content must not
    m.files["extra.ema.pt"] = FileEntry(
        (bad / "extra.ema.pt").stat().st_size, digest_file(bad / "extra.ema.pt")
    )
    (bad / MANIFEST).write_bytes(m.to_json())
    problems = validate_dir(bad)  # no recipe: the part is known by its file name
    assert [str(p) for p in problems] == ["NaN/Inf in /shadow/0.weight in extra.ema.pt"]


@pytest.mark.parametrize(
    ("registered", "message"),
    [
        ({"ema"}, "holds part 'calls' (extra.calls.pt), which this job does not register"),
        ({"ema", "calls", "swa"}, "has no part 'swa' (extra.swa.pt), which this job registers"),
    ],
)
def test_validation_names_an_unknown_or_missing_part(runs: Path, registered: set[str], message: str) -> None:
    expect = Expectation.from_registry(_registry(registered), None)
    problems = validate_dir(runs / "parts" / step_dir(20), expect)
    assert [(p.kind, str(p)) for p in problems] == [("compat", message)]


@pytest.mark.parametrize(
    ("registered", "message"),
    [
        ({"ema"}, r"step_000000020 holds 'calls' \(extra.calls.pt\), which nothing here loads"),
        ({"ema", "calls", "swa"}, r"step_000000020 lacks 'swa' \(extra.swa.pt\)"),
    ],
)
def test_loading_refuses_an_unknown_or_missing_part_by_name(
    runs: Path, registered: set[str], message: str
) -> None:
    with pytest.raises(ResumeIncompatible, match=message):
        load_state(runs / "parts" / step_dir(20), _registry(registered))
    assert (runs / "parts" / step_dir(20) / MANIFEST).is_file()


def test_resuming_without_a_registered_part_is_refused_with_its_name(
    runs: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(extra_recipe, "EXTRA", {"ema"})  # same spec and shape hash; the recipe changed
    more = JobSpec.model_validate({**SPEC, "total_steps": 30})
    with pytest.raises(ResumeIncompatible, match=r"holds part 'calls' \(extra.calls.pt\)"):
        run_attempt(more, LocalStorage(runs / "full"), AttemptOptions(cache=runs / "c3"))
