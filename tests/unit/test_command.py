"""Command mode's pure parts and its checkpoint round trip: which of a script's checkpoints are complete,
what its exit means, what the job file accepts, the steps file, publishing and restoring through a
directory store (with the fallback past a damaged newest one), and the model-free content checks."""

from __future__ import annotations

import json
import os
import pickle
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from pydantic import ValidationError

from spotrun.tasks.admission.trust import named
from spotrun.trainer.checkpoint.manifest import DIRECTORY, MANIFEST, step_dir
from spotrun.trainer.checkpoint.validate import validate_dir
from spotrun.trainer.command.layouts import MARKER, Found, Seen, find
from spotrun.trainer.command.link import CommandLink, read_steps, write_notice
from spotrun.trainer.command.publish import publish, restore
from spotrun.trainer.command.runner import _classify, _Follower, script_environ
from spotrun.trainer.errors import ConfigError
from spotrun.trainer.exitcodes import ExitCode
from spotrun.trainer.spec.job import JobSpec
from spotrun.trainer.storage import LocalStorage
from spotrun.trainer.telemetry.status import StatusReporter


def hf(root: Path, step: int, state_step: int | None = None, state: str | None = None) -> Path:
    d = root / f"checkpoint-{step}"
    d.mkdir(parents=True)
    torch.save({"w": torch.ones(2)}, d / "optimizer.pt")
    (d / "training_args.bin").write_bytes(b"\x80\x04opaque pickle")
    body = state if state is not None else json.dumps({"global_step": state_step or step})
    (d / "trainer_state.json").write_text(body)
    return d


def marked(root: Path, name: str, content: str | None) -> Path:
    d = root / name
    d.mkdir(parents=True)
    torch.save({"w": torch.zeros(3)}, d / "state.pt")
    if content is not None:
        (d / MARKER).write_text(content)
    return d


# (case, build the directory, the steps found with their layouts)
LAYOUTS: list[tuple[str, Any, list[tuple[int, str]]]] = [
    ("nothing", lambda r: None, []),
    ("an HF checkpoint", lambda r: hf(r, 10), [(10, "transformers")]),
    ("HF without trainer_state.json yet", lambda r: hf(r, 10, state=""), []),
    ("HF with a half-written state", lambda r: hf(r, 10, state='{"global_st'), []),
    ("HF whose state names another step", lambda r: hf(r, 10, state_step=9), []),
    ("two HF checkpoints", lambda r: (hf(r, 20), hf(r, 10)), [(10, "transformers"), (20, "transformers")]),
    ("a marker with a number", lambda r: marked(r, "ckpt-a", "12"), [(12, "marker")]),
    ("a marker with JSON", lambda r: marked(r, "nested/ckpt", '{"step": 7}'), [(7, "marker")]),
    ("a directory without its marker", lambda r: marked(r, "ckpt-a", None), []),
    ("an empty marker (being written)", lambda r: marked(r, "ckpt-a", ""), []),
    ("a negative step", lambda r: marked(r, "ckpt-a", "-3"), []),
    ("a Lightning file", lambda r: torch.save({}, r / "epoch=0-step=30.ckpt"), [(30, "lightning")]),
    ("a .ckpt without a step", lambda r: torch.save({}, r / "last.ckpt"), []),
]  # fmt: skip  # a decision table, one case per row


@pytest.mark.parametrize(("case", "build", "expected"), LAYOUTS, ids=[c[0] for c in LAYOUTS])
def test_which_checkpoints_are_complete(tmp_path: Path, case: str, build: Any, expected: list) -> None:
    root = tmp_path / "out"
    root.mkdir()
    build(root)
    assert [(f.step, f.layout) for f in find(root)] == expected


def test_an_hf_checkpoint_is_its_files_by_path(tmp_path: Path) -> None:
    hf(tmp_path, 10)
    (found,) = find(tmp_path)
    assert found.files == (
        "checkpoint-10/optimizer.pt",
        "checkpoint-10/trainer_state.json",
        "checkpoint-10/training_args.bin",
    )


def test_a_lightning_file_counts_once_it_holds_still(tmp_path: Path) -> None:
    seen: Seen = {}
    ckpt = tmp_path / "epoch=0-step=30.ckpt"
    ckpt.write_bytes(b"x" * 10)
    assert find(tmp_path, seen) == []  # first look: maybe still being written
    assert [f.step for f in find(tmp_path, seen)] == [30]
    ckpt.write_bytes(b"x" * 20)
    os.utime(ckpt, ns=(1, 1))
    assert find(tmp_path, seen) == []  # it changed: wait for the next look again


# (script's exit code, a stop was forwarded, the attempt's code)
EXITS = [
    (0, False, ExitCode.COMPLETED),
    (0, True, ExitCode.PREEMPTED),  # stopped early at our request: the next attempt finds out
    (75, True, ExitCode.PREEMPTED),
    (75, False, ExitCode.PREEMPTED),
    (-15, True, ExitCode.PREEMPTED),  # killed by the forwarded signal
    (-9, False, ExitCode.CRASHED),  # killed by someone else (an OOM)
    (1, False, ExitCode.CRASHED),
    (1, True, ExitCode.CRASHED),
    (2, False, ExitCode.CONFIG_ERROR),  # argparse's usage error: not retried
    (3, False, ExitCode.DIVERGED),
    (137, False, ExitCode.CRASHED),
]


@pytest.mark.parametrize(("rc", "stopped", "code"), EXITS)
def test_a_scripts_exit_is_classified(rc: int, stopped: bool, code: ExitCode) -> None:
    assert _classify(rc, stopped) is code


# (exit code, stop forwarded, the job's last step durable): a notice during the last steps, trained through
@pytest.mark.parametrize(
    ("rc", "stopped", "code"),
    [
        (0, True, ExitCode.COMPLETED),
        (75, True, ExitCode.COMPLETED),  # the callback's stop exit after the save of the last step
        (-15, True, ExitCode.COMPLETED),
        (1, True, ExitCode.CRASHED),
        (0, False, ExitCode.COMPLETED),
    ],
)
def test_a_script_stopped_after_its_last_step_is_durable_completed(
    rc: int, stopped: bool, code: ExitCode
) -> None:
    assert _classify(rc, stopped, finished=True) is code


def spec(tmp_path: Path, **fields: Any) -> JobSpec:
    base = {"name": "cmd", "command": ["python", "train.py", "{checkpoint_dir}"], "total_steps": 10}
    return JobSpec.model_validate(base | {"storage": str(tmp_path / "store")} | fields)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"recipe": "digits"}, "recipe and command are exclusive"),
        ({"command": []}, "command is empty"),
        ({"command": ["python", "t.py", "{outdir}"]}, "command[2]: unknown placeholder {outdir}"),
        ({"command": ["python", "{checkpoint_dir"]}, "command[1]: a stray '{' in"),
        ({"stop_signal": "SIGKILL"}, "stop_signal"),
    ],
)
def test_a_bad_command_is_one_line(tmp_path: Path, fields: dict[str, Any], message: str) -> None:
    with pytest.raises(ValidationError, match=message.replace("[", r"\[").replace("{", r"\{")):
        spec(tmp_path, **fields)


def test_the_command_is_shape_and_the_deployments_allow_list_names_it(tmp_path: Path) -> None:
    a, b = spec(tmp_path), spec(tmp_path, command=["python", "other.py"])
    assert a.shape_hash() != b.shape_hash()
    assert named({"job": a.model_dump(mode="json")}).commands == {"python train.py '{checkpoint_dir}'"}


def test_the_steps_file_is_read_a_whole_line_at_a_time(tmp_path: Path) -> None:
    f = tmp_path / "steps.jsonl"
    f.write_text('{"step": 1, "loss": 0.5}\nnot json\n{"step": -1}\n{"nostep": 1}\n{"step": 2}\n{"step": 3')
    lines, offset = read_steps(f, 0)
    assert [line["step"] for line in lines] == [1, 2]
    with f.open("a") as out:
        out.write(', "loss": 0.25}\n')
    lines, _ = read_steps(f, offset)
    assert lines == [{"step": 3, "loss": 0.25}]


def test_the_scripts_link_reads_the_notice_and_reports_steps(tmp_path: Path) -> None:
    env = {
        "SPOTRUN_CHECKPOINT_DIR": str(tmp_path / "out"),
        "SPOTRUN_RESUME_STEP": "20",
        "SPOTRUN_TOTAL_STEPS": "60",
        "SPOTRUN_NOTICE_FILE": str(tmp_path / "notice.json"),
        "SPOTRUN_STEPS_FILE": str(tmp_path / "steps.jsonl"),
    }
    assert CommandLink.from_env({}) is None  # outside spotrun: nothing to do
    link = CommandLink.from_env(env)
    assert link is not None and (link.resume_step, link.total_steps) == (20, 60)
    assert not link.stop_requested and link.notice() == {}
    write_notice(tmp_path / "notice.json", "spot", 1234.5)
    assert link.stop_requested and link.notice() == {"reason": "spot", "deadline": 1234.5}
    link.report(21, 0.5, lr=1e-3, grad_norm=float("nan"), acc=0.75)
    (line,) = read_steps(tmp_path / "steps.jsonl", 0)[0]
    assert line == {"step": 21, "loss": (0.5).hex(), "lr": (1e-3).hex(), "m": {"acc": (0.75).hex()}}
    link.report(25, 0.25, compare=False)  # a mean over a window a resume cut short: MLflow's, not compared
    (line,) = read_steps(tmp_path / "steps.jsonl", 0)[0][1:]
    assert line == {"step": 25, "compare": False, "loss": (0.25).hex()}


# (the step this process last logged at or resumed from, logging strategy, logging_steps,
#  logging_first_step: whether the next mean HF logs covers the steps an uninterrupted run's does)
WINDOWS = [
    (0, "steps", 5, False, True),  # a first start
    (10, "steps", 5, False, True),  # resumed at a logging step (a save_steps multiple)
    (12, "steps", 5, False, False),  # resumed from a notice's save between two logging steps
    (1, "steps", 5, True, True),  # logged at step 1 (logging_first_step)
    (1, "steps", 5, False, False),
    (0, "epoch", 5, False, True),
    (20, "epoch", 5, False, False),  # an epoch's mean: a resume anywhere may have cut it
]


@pytest.mark.parametrize(("since", "strategy", "every", "first", "whole"), WINDOWS)
def test_a_logged_mean_is_compared_only_when_its_window_is_whole(
    since: int, strategy: str, every: int, first: bool, whole: bool
) -> None:
    from spotrun.integrations.transformers import _logs_at  # here: importing transformers takes seconds

    args = SimpleNamespace(logging_strategy=strategy, logging_first_step=first)
    assert _logs_at(since, args=args, state=SimpleNamespace(logging_steps=every)) is whole


def test_published_checkpoints_restore_the_newest_valid_one_at_their_paths(tmp_path: Path) -> None:
    job, out = spec(tmp_path), tmp_path / "out"
    store = LocalStorage(tmp_path / "store")
    for step in (10, 20):
        hf(out, step)
        found = next(f for f in find(out) if f.step == step)
        manifest = publish(found, root=out, storage=store, cache=tmp_path / "cache", spec=job)
        assert manifest.layout == DIRECTORY and set(manifest.files) == set(found.files)
    newest = tmp_path / "store" / step_dir(20)
    assert validate_dir(newest) == []
    into = tmp_path / "restored"
    selection = restore(store, cache=tmp_path / "rcache", into=into)
    assert selection.step == 20
    assert sorted(p.relative_to(into).as_posix() for p in into.rglob("*") if p.is_file()) == list(
        Found(
            20, "transformers", tuple(sorted(f"checkpoint-20/{n}" for n in os.listdir(out / "checkpoint-20")))
        ).files
    )
    # damage the newest: the one before is restored, and the refusal says why
    (newest / "checkpoint-20" / "optimizer.pt").write_bytes(b"rot")
    selection = restore(store, cache=tmp_path / "rcache", into=into)
    assert selection.step == 10 and "checkpoint-20/optimizer.pt" in selection.rejected[0].reason()
    assert [p.name for p in into.iterdir()] == ["checkpoint-10"]  # emptied first: nothing of 20 is left


def test_a_store_of_another_kind_of_job_is_refused_in_one_line(tmp_path: Path) -> None:
    store = LocalStorage(tmp_path / "store")
    out = tmp_path / "out"
    hf(out, 10)
    (found,) = find(out)
    publish(found, root=out, storage=store, cache=tmp_path / "cache", spec=spec(tmp_path))
    m = tmp_path / "store" / step_dir(10) / MANIFEST
    m.write_text(m.read_text().replace('"layout": "directory"', '"layout": "single"'))
    with pytest.raises(ConfigError, match="not by a command; use a new storage URI"):
        restore(store, cache=tmp_path / "rcache", into=tmp_path / "restored")


class Boom:
    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, ("echo pwned",))


# (case, file name, what it holds, the problem's kind or None)
CONTENTS: list[tuple[str, str, Any, str | None]] = [
    ("finite tensors", "optimizer.pt", lambda p: torch.save({"a": torch.ones(2)}, p), None),
    ("a NaN", "optimizer.pt", lambda p: torch.save({"a": torch.tensor([1.0, float("nan")])}, p), "content"),
    ("code in a pickle", "rng_state.pth", lambda p: p.write_bytes(pickle.dumps(Boom())), "structure"),
    ("numpy RNG state (HF's)", "rng_state.pth",
     lambda p: torch.save({"numpy": __import__("numpy").random.get_state()}, p), None),
    ("HF's training args: digest only", "training_args.bin",
     lambda p: p.write_bytes(pickle.dumps(Boom())), None),
    ("bad JSON", "trainer_state.json", lambda p: p.write_text("{"), "structure"),
    ("an Inf in safetensors", "model.safetensors",
     lambda p: __import__("safetensors.torch").torch.save_file({"w": torch.tensor([float("inf")])}, str(p)),
     "content"),
    ("other files: digest only", "notes.txt", lambda p: p.write_text("anything"), None),
]  # fmt: skip  # a decision table, one case per row


@pytest.mark.parametrize(("case", "name", "write", "kind"), CONTENTS, ids=[c[0] for c in CONTENTS])
def test_content_checks_need_no_model(
    tmp_path: Path, case: str, name: str, write: Any, kind: str | None
) -> None:
    out = tmp_path / "out" / "ckpt"
    out.mkdir(parents=True)
    write(out / name)
    (out / MARKER).write_text("5")
    (found,) = find(tmp_path / "out")
    store = LocalStorage(tmp_path / "store")
    publish(found, root=tmp_path / "out", storage=store, cache=tmp_path / "cache", spec=spec(tmp_path))
    problems = validate_dir(tmp_path / "store" / step_dir(5))
    assert [p.kind for p in problems] == ([kind] if kind else [])


def test_the_restored_checkpoint_is_no_sign_that_the_script_trained(tmp_path: Path) -> None:
    """The training clock (the `started` record: reclaims and restart cost count from it) starts at the
    script's first step or first new checkpoint, not when the checkpoint spotrun restored holds still."""
    ckpt_dir = tmp_path / "checkpoints"
    ckpt_dir.mkdir()
    torch.save({}, ckpt_dir / "spotrun-step=30.ckpt")
    began: list[bool] = []
    follower = _Follower(
        spec=Any,  # type: ignore[arg-type]  # not read until a checkpoint is published
        storage=LocalStorage(tmp_path / "store"),
        opts=Any,  # type: ignore[arg-type]
        ckpt_dir=ckpt_dir,
        steps_file=tmp_path / "steps.jsonl",
        step=30,
        durable=30,
        started=lambda: began.append(True),
    )
    for _ in range(3):
        follower.look()
    follower.look(settled=True)
    assert began == []


def test_the_lightning_callbacks_rng_state_loads_weights_only_and_restores(tmp_path: Path) -> None:
    """Lightning loads a local ckpt_path with torch's default, weights_only=True: the RNG states the
    callback keeps in the checkpoint must be rebuilt by it (numpy's state as a tensor, no numpy object)."""
    import random

    import numpy as np

    from spotrun.integrations.lightning import _get_rng, _set_rng

    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    torch.save({"rng": _get_rng()}, tmp_path / "c.ckpt")
    expected = (random.random(), np.random.rand(), torch.rand(1))
    random.seed(9), np.random.seed(9), torch.manual_seed(9)
    _set_rng(torch.load(tmp_path / "c.ckpt", weights_only=True)["rng"])
    assert (random.random(), np.random.rand()) == expected[:2] and torch.equal(torch.rand(1), expected[2])


def test_an_evaluation_the_script_reports_is_a_section_record_and_no_step(tmp_path: Path) -> None:
    env = {
        "SPOTRUN_CHECKPOINT_DIR": str(tmp_path / "out"),
        "SPOTRUN_NOTICE_FILE": str(tmp_path / "notice.json"),
        "SPOTRUN_STEPS_FILE": str(tmp_path / "s.jsonl"),
    }
    link = CommandLink.from_env(env)
    assert link is not None
    link.report(7, 0.5)
    link.section("eval", begin=True, step=7)
    link.section("eval", begin=False, step=7)
    records: list[Any] = []
    reporter = StatusReporter()
    reporter.subscribe(records.append)
    follower = _Follower(
        spec=Any,  # type: ignore[arg-type]  # not read until a checkpoint is published
        storage=LocalStorage(tmp_path / "store"),
        opts=SimpleNamespace(reporter=reporter),  # type: ignore[arg-type]
        ckpt_dir=tmp_path / "out",
        steps_file=tmp_path / "s.jsonl",
        step=0,
        durable=None,
    )
    follower.look()
    assert [(r.kind, getattr(r, "begin", None), r.step) for r in records] == [
        ("step", None, 7),
        ("section", True, 7),
        ("section", False, 7),
    ]
    assert follower.step == 7


def test_the_script_never_holds_the_manifest_keys() -> None:
    """The trainer signs what it publishes of the script's checkpoints; the script (and whatever it loads)
    gets the rest of the environment, not the keys."""
    environ = {
        "SPOTRUN_MANIFEST_KEY": "k" * 32,
        "SPOTRUN_MANIFEST_KEYS_OLD": "o" * 32,
        "HF_HOME": "/h",
        "PATH": "/b",
    }
    assert script_environ(environ) == {"HF_HOME": "/h", "PATH": "/b"}
