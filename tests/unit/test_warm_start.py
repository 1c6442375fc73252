"""Warm start (trainer/session/warm_start.py) and the promotion gate's eval block in COMPLETED.json, on a tiny
digits run trained in-process into a directory store (8 steps: milliseconds once torch is warm)."""

from __future__ import annotations

import io
import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import pytest
import torch
from safetensors.torch import load_file

from spotrun.trainer import recipes
from spotrun.trainer.__main__ import _exit_code
from spotrun.trainer.checkpoint.completion import completed_eval
from spotrun.trainer.checkpoint.format import COMPLETED, MANIFEST, Manifest, file_entry, step_dir, write_part
from spotrun.trainer.checkpoint.signing import KEY_ENV
from spotrun.trainer.checkpoint.stateful import Codec
from spotrun.trainer.errors import ConfigError, TransientStorageError
from spotrun.trainer.exitcodes import ExitCode
from spotrun.trainer.recipes import Parts, RecipeContext
from spotrun.trainer.session.loop import AttemptOptions, run_attempt
from spotrun.trainer.session.warm_start import warm_start
from spotrun.trainer.spec.job import JobSpec
from spotrun.trainer.storage import LocalStorage, Storage
from spotrun.trainer.telemetry.records import WarmStarted
from spotrun.trainer.telemetry.status import StatusReporter, parse_status_line
from tests.trainer_runs import assert_states_equal

STEPS = 8
ARGS = {"hidden": 16, "holdout": 200}
BASE: dict[str, Any] = {
    "recipe": "digits",
    "args": ARGS,
    "total_steps": STEPS,
    "batch_size": 32,
    "threads": 1,
    "checkpoint": {"every_steps": 4, "keep": 2},
}


def _attempt(spec: dict[str, Any], store: Path, cache: Path, **kw: Any) -> Any:
    return run_attempt(JobSpec.model_validate(spec), LocalStorage(store), AttemptOptions(cache=cache, **kw))


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A completed run (the night before) whose final checkpoint is step 8, with its own eval block."""
    root = tmp_path_factory.mktemp("source")
    _attempt({**BASE, "name": "nightly", "promote": {}}, root / "store", root / "cache")
    return root / "store"


def _source(uri: str | Path, step: int = STEPS) -> dict[str, Any]:
    return {"job": "nightly", "run_key": "2026-12-04", "storage": str(uri), "step": step, "version": "3"}


def _spec(
    src: dict[str, Any] | None, on_missing: str = "fresh", parts: tuple[str, ...] = ("model",), **kw: Any
) -> JobSpec:
    init = {"job": "nightly", "parts": list(parts), "on_missing": on_missing, "source": src}
    return JobSpec.model_validate({**BASE, "name": "nightly", "init_from": init, **kw})


def _build(spec: JobSpec) -> Parts:
    torch.manual_seed(spec.seed)
    ctx = RecipeContext(spec.seed, spec.total_steps, spec.batch_size, torch.device("cpu"))
    return recipes.build(spec.recipe, spec.args, ctx)


def _weights(parts: Parts) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in parts.model.state_dict().items()}


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _corrupt(source: Path, tmp: Path) -> Path:
    store = tmp / "corrupt"
    shutil.copytree(source, store)
    f = store / step_dir(STEPS) / "model.safetensors"
    data = bytearray(f.read_bytes())
    data[-1] ^= 0xFF  # a flipped bit in a weight: the same size, another digest
    f.write_bytes(bytes(data))
    return store


# (case, the source it names, the spec's args, what fresh says, what refuse says)
Case = tuple[str, Callable[[Path, Path], dict[str, Any] | None], dict[str, Any], str]
CASES: list[Case] = [
    ("no source", lambda s, t: None, ARGS, "has no run to warm-start from"),
    ("missing storage", lambda s, t: _source(t / "gone"), ARGS, "does not exist"),
    ("missing step", lambda s, t: _source(s, step=5), ARGS, "no such checkpoint"),
    ("corrupted digest", lambda s, t: _source(_corrupt(s, t)), ARGS, "model.safetensors"),
    ("other shapes", lambda s, t: _source(s), {**ARGS, "hidden": 24}, "expected"),
]


@pytest.mark.parametrize("on_missing", ["fresh", "refuse"])
@pytest.mark.parametrize(("case", "src", "args", "says"), CASES, ids=[c[0] for c in CASES])
def test_no_usable_source_starts_fresh_or_refuses_in_one_line(
    source: Path, tmp_path: Path, on_missing: str, case: str, src: Any, args: dict[str, Any], says: str
) -> None:
    spec = _spec(src(source, tmp_path), on_missing, parts=("model", "optimizer"), args=args)
    parts = _build(spec)
    before = _weights(parts)
    if on_missing == "refuse":
        with pytest.raises(ConfigError) as e:
            warm_start(spec, parts, tmp_path / "cache")
        line = str(e.value)
        assert says in line and "on_missing: fresh" in line and "\n" not in line
        assert _exit_code(e.value)[0] is ExitCode.CONFIG_ERROR
        return
    got = warm_start(spec, parts, tmp_path / "cache")
    assert got is not None and not got.loaded and says in got.reason
    assert _same(_weights(parts), before) and not parts.optimizer.state  # fresh: nothing half-loaded


def test_an_unverifiable_source_refuses_even_with_on_missing_fresh(
    source: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(KEY_ENV, "a key the source was never signed with")
    with pytest.raises(ConfigError, match=r"cannot be verified .*give this worker the key"):
        warm_start(_spec(_source(source)), _build(_spec(None)), tmp_path / "cache")


def test_a_distributed_job_refuses_a_source_it_cannot_load_and_starts_fresh_without_one(
    source: Path, tmp_path: Path
) -> None:
    ranks = {"nproc_per_node": 2}
    with pytest.raises(ConfigError, match=r"this job is distributed .*remove init_from or distributed"):
        warm_start(_spec(_source(source), distributed=ranks), _build(_spec(None)), tmp_path / "cache")
    got = warm_start(_spec(None, distributed=ranks), _build(_spec(None)), tmp_path / "cache")
    assert got is not None and not got.loaded


class Flaky:
    """A store whose listing fails `failures` times with a retryable error first."""

    def __init__(self, inner: Storage, failures: int) -> None:
        self.inner, self.failures = inner, failures

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def list(self, prefix: str = "") -> Any:
        if self.failures:
            self.failures -= 1
            raise TransientStorageError("503 SlowDown")
        return self.inner.list(prefix)


@pytest.mark.parametrize(("failures", "waits"), [(2, [1.0, 2.0]), (9, [1.0, 2.0, 4.0])])
def test_a_transient_read_error_is_retried_not_taken_for_a_missing_source(
    source: Path, tmp_path: Path, failures: int, waits: list[float]
) -> None:
    spec = _spec(_source(source), on_missing="refuse")
    flaky = cast(Storage, Flaky(LocalStorage(source), failures))
    slept: list[float] = []

    def read() -> WarmStarted | None:
        return warm_start(
            spec, _build(spec), tmp_path / "c", open_store=lambda uri: flaky, sleep=slept.append
        )

    if failures <= len(waits):
        assert (got := read()) is not None and got.loaded
    else:
        with pytest.raises(TransientStorageError):  # out of retries: the attempt fails, and is retried
            read()
    assert slept == waits


def test_model_only_loads_the_weights_and_leaves_the_optimizer_fresh(source: Path, tmp_path: Path) -> None:
    spec = _spec(_source(source), parts=("model",))
    parts = _build(spec)
    got = warm_start(spec, parts, tmp_path / "cache")
    assert got == WarmStarted("nightly", "2026-12-04", STEPS, ("model",), loaded=True)
    assert _same(_weights(parts), load_file(str(source / step_dir(STEPS) / "model.safetensors")))
    assert not parts.optimizer.state


def test_optimizer_state_loads_but_this_runs_learning_rates_stand(source: Path, tmp_path: Path) -> None:
    spec = _spec(_source(source), parts=("model", "optimizer"), args={**ARGS, "lr": 0.01})
    parts = _build(spec)
    groups = [{k: v for k, v in g.items() if k != "params"} for g in parts.optimizer.param_groups]
    assert warm_start(spec, parts, tmp_path / "cache") is not None
    saved = torch.load(source / step_dir(STEPS) / "optimizer.pt", weights_only=True)["state"]
    mine = parts.optimizer.state_dict()
    assert mine["state"].keys() == saved["state"].keys()
    for i, st in saved["state"].items():
        assert all(torch.equal(t, mine["state"][i][k]) for k, t in st.items())
    assert [{k: v for k, v in g.items() if k != "params"} for g in parts.optimizer.param_groups] == groups
    assert saved["param_groups"][0]["lr"] != groups[0]["lr"]  # the old run's final lr was not taken


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
def test_a_sharded_source_loads_by_parameter_name(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    spec = _spec(_source(tmp_path / "dcp"), parts=("model", "optimizer"), on_missing="refuse")
    theirs = _build(spec)
    torch.manual_seed(1)
    theirs.loss_fn(theirs.model, (torch.randn(4, 64), torch.tensor([0, 1, 2, 3]))).backward()
    theirs.optimizer.step()
    d = tmp_path / "dcp" / step_dir(STEPS)
    msd, osd = get_state_dict(theirs.model, theirs.optimizer)
    dcp.save({"model": msd, "optimizer": osd}, checkpoint_id=str(d))
    write_part(d / "scheduler.pt", Codec.TORCH, {}, step=STEPS)
    write_part(d / "trainer.pt", Codec.TORCH, {"spec": {}, "shape_hash": "h"}, step=STEPS)
    files = {p.name: file_entry(p) for p in d.iterdir()}
    manifest = Manifest(STEPS, "s", "h", world_size=2, files=files, layout="sharded", strategy="fsdp")
    (d / MANIFEST).write_bytes(manifest.to_json())
    parts = _build(spec)
    assert warm_start(spec, parts, tmp_path / "cache") is not None
    assert _same(_weights(parts), _weights(theirs))
    mine, want = parts.optimizer.state_dict()["state"], theirs.optimizer.state_dict()["state"]
    assert all(torch.equal(t, mine[i][k]) for i, st in want.items() for k, t in st.items())


def _started(out: io.StringIO) -> dict[str, Any]:
    records = [r.to_json() for line in out.getvalue().splitlines() if (r := parse_status_line(line))]
    return next(r for r in records if r["kind"] == "started")


def test_a_resumed_warm_started_run_never_reads_the_source_again_and_ends_bitwise_equal(
    source: Path, tmp_path: Path
) -> None:
    src = tmp_path / "src"
    shutil.copytree(source, src)
    spec = _spec(_source(src), on_missing="refuse", parts=("model", "optimizer")).model_dump(mode="json")
    _attempt(spec, tmp_path / "whole", tmp_path / "c1")
    first, second = io.StringIO(), io.StringIO()
    assert (
        _attempt(spec, tmp_path / "split", tmp_path / "c2", max_steps=5, reporter=StatusReporter(first)).step
        == 5
    )
    shutil.rmtree(src)  # a resume that read it again would refuse
    done = _attempt(spec, tmp_path / "split", tmp_path / "c2", reporter=StatusReporter(second))
    assert (done.code, done.resumed_from) == (ExitCode.COMPLETED, 5)
    assert_states_equal(tmp_path / "whole" / step_dir(STEPS), tmp_path / "split" / step_dir(STEPS))
    lineage = {"job": "nightly", "run_key": "2026-12-04", "step": STEPS, "parts": ["model", "optimizer"]}
    for out in (first, second):  # the resumed attempt reports the first one's, from its checkpoint
        assert _started(out)["warm_start"] == {**lineage, "loaded": True, "reason": ""}
    marker = json.loads((tmp_path / "split" / COMPLETED).read_text())
    assert marker["spec"]["init_from"]["source"]["storage"] == str(src)  # the spec names the source
    assert "eval" not in marker and completed_eval(LocalStorage(tmp_path / "split")) is None  # no promote


def test_completed_json_holds_both_evaluations_on_the_same_data_signed(
    source: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    src = _source(source)
    spec = {**BASE, "name": "nightly", "promote": {"champion": src}}
    _attempt(spec, tmp_path / "s", tmp_path / "c")
    block = completed_eval(LocalStorage(tmp_path / "s"))
    assert (
        block is not None
        and block["skipped"] == ""
        and set(block["metrics"]) == {"eval_loss", "eval_accuracy"}
    )
    champion = block["champion"]
    assert {k: champion[k] for k in ("job", "run_key", "step", "version", "reason")} == {
        "job": "nightly",
        "run_key": "2026-12-04",
        "step": STEPS,
        "version": "3",
        "reason": "",
    }
    # the champion's weights on this run's data: what the source measured on the same held-out images
    assert champion["metrics"] == completed_eval(LocalStorage(source))["metrics"]  # type: ignore[index]

    monkeypatch.setenv(KEY_ENV, "k")  # signed from here on: the marker, and the champion it reads
    other = tmp_path / "other"  # of another shape: no champion metrics, and the reason
    _attempt({**BASE, "name": "other", "args": {**ARGS, "hidden": 24}}, other, tmp_path / "c0")
    spec["promote"] = {"champion": {**src, "storage": str(other)}}
    _attempt(spec, tmp_path / "signed", tmp_path / "c2")
    block = completed_eval(LocalStorage(tmp_path / "signed"))
    assert (
        block is not None
        and block["champion"]["metrics"] is None
        and "expected" in block["champion"]["reason"]
    )
    marker = json.loads((tmp_path / "signed" / COMPLETED).read_text())
    assert marker["signature"]
    marker["eval"]["metrics"]["eval_loss"] = 0.0  # a better score written into the bucket
    (tmp_path / "signed" / COMPLETED).write_text(json.dumps(marker))
    assert completed_eval(LocalStorage(tmp_path / "signed")) is None
