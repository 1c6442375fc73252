"""A job's entry point (trainer/spec/entrypoints.py, tasks/admission/entrypoint_check.py): its form, how it
is called, and `spotrun run`'s import check in a subprocess (real ones), which a project's own modules
named like spotrun's rooms (`trainer.py`, `tasks/`) pass: spotrun's own are all under `spotrun.`."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from spotrun.tasks.admission.entrypoint_check import entrypoint_refusal, import_fix, worker_path
from spotrun.trainer.errors import ConfigError
from spotrun.trainer.spec.entrypoints import (
    call_main,
    code_problem,
    entrypoint_problem,
    resolve_entrypoint,
    takes_args,
)
from spotrun.trainer.spec.job import JobSpec


@pytest.mark.parametrize(
    ("value", "problem"),
    [
        ("mypkg.train:main", None),
        ("train:main", None),
        ("_p.a_1.b:run_2", None),
        ("mypkg.train", "is not package.module:function: write e.g. 'mypkg.train:main'"),
        ("mypkg.train:", "is not package.module:function"),
        (":main", "is not package.module:function"),
        ("1pkg:main", "is not package.module:function"),
        ("mypkg:Trainer.fit", "is not package.module:function"),
        ("train.py:main", "names a file: use the module as you would import it, e.g. 'train:main'"),
        ("src/mypkg/train.py:main", "names a file: use the module as you would import it, e.g. 'src.mypkg"),
    ],
)
def test_entrypoint_form(value: str, problem: str | None) -> None:
    got = entrypoint_problem(value)
    assert got is None if problem is None else (got is not None and problem in got)


@pytest.mark.parametrize(
    ("given", "problem"),
    [
        ({"recipe": True, "entrypoint": False}, None),
        ({"recipe": False, "entrypoint": True}, None),
        ({"recipe": False, "entrypoint": False}, "name the code to run: add recipe: digits, charlm or"),
        ({"recipe": True, "entrypoint": True}, "recipe and entrypoint are exclusive (one way in per job)"),
        ({"recipe": True, "entrypoint": True, "command": True}, "recipe and entrypoint and command are excl"),
        ({"recipe": False, "entrypoint": False, "command": False}, "; or command"),  # 17's field joins
    ],
)
def test_exactly_one_way_in(given: dict[str, bool], problem: str | None) -> None:
    got = code_problem(given)
    assert got is None if problem is None else (got is not None and problem in got and "\n" not in got)


def no_args() -> str:
    return "()"


def one_arg(args: dict[str, Any]) -> str:
    return f"({args})"


def optional_arg(args: dict[str, Any] | None = None) -> str:
    return f"({args})"


def star_args(*a: Any) -> str:
    return f"{a}"


def two_args(args: dict[str, Any], ctx: Any) -> None: ...


def keyword(*, args: dict[str, Any]) -> None: ...


@pytest.mark.parametrize(
    ("fn", "called"),
    [
        (no_args, "()"),
        (one_arg, "({'lr': 1})"),
        (optional_arg, "({'lr': 1})"),
        (star_args, "({'lr': 1},)"),
        (two_args, "must take no argument or one (the job's args), not (args, ctx)"),
        (keyword, "must take no argument or one (the job's args), not (args)"),
    ],
)
def test_main_args_or_main(fn: Callable[..., Any], called: str) -> None:
    if called.startswith("must"):
        with pytest.raises(ConfigError, match=called.replace("(", r"\(").replace(")", r"\)")):
            takes_args(fn, "m:f")
        return
    assert call_main(fn, {"lr": 1}, "m:f") == called


@pytest.mark.parametrize(
    ("entrypoint", "message"),
    [
        (
            "nosuch_pkg_7f3e.train:main",
            "cannot import 'nosuch_pkg_7f3e.train' (ModuleNotFoundError: No module",
        ),
        ("json:no_such_function", "has no function 'no_such_function'; fix the name after the colon"),
        ("json:__doc__", "has no function '__doc__'"),  # there, but not callable
    ],
)
def test_resolve_refuses_in_one_line(entrypoint: str, message: str) -> None:
    with pytest.raises(ConfigError) as e:
        resolve_entrypoint(entrypoint)
    assert message in str(e.value) and "\n" not in str(e.value)
    assert resolve_entrypoint("json:dumps")([1]) == "[1]"


def test_the_worker_path_is_its_directory_then_pythonpath(tmp_path: Path) -> None:
    """As `python -m` in that directory would have it; nothing of spotrun's: it is an installed package."""
    assert worker_path(tmp_path, f"/x{os.pathsep}/y") == [str(tmp_path), "/x", "/y"]
    assert worker_path(tmp_path, None) == [str(tmp_path)]
    assert worker_path(tmp_path, f"{tmp_path}{os.pathsep}{os.pathsep}/x") == [
        str(tmp_path),
        "/x",
    ]  # each once
    assert worker_path(None, None) == []


PROJECT = {
    "trainer.py": "OWNER = 'project'\n",
    "tasks/__init__.py": "REGISTRY = {'a': 1}\n",
    "flows/__init__.py": "",
    "deployments/__init__.py": "",
    "utils.py": "HELPER = 2\n",
    "own_loop_4d2.py": (
        "import deployments, flows, utils\nfrom tasks import REGISTRY\nfrom trainer import OWNER\n"
        "import spotrun.trainer\nassert OWNER == 'project' and REGISTRY and utils.HELPER == 2\n"
        "def main():\n    pass\n"
    ),
}


def test_a_project_with_its_own_trainer_and_tasks_modules_is_accepted(tmp_path: Path) -> None:
    """The loop imports the project's `trainer`, `tasks`, `flows` and `deployments`, and spotrun's own
    `spotrun.trainer` beside them: the import check (a real `python -P`, as a worker) passes."""
    for name, text in PROJECT.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    spec = JobSpec(name="j", entrypoint="own_loop_4d2:main", total_steps=1)
    assert entrypoint_refusal(spec, None, {"PATH": os.environ.get("PATH", "")}, tmp_path) is None


def test_spotrun_run_imports_the_entrypoint_in_a_subprocess(tmp_path: Path) -> None:
    """One real `python -P`: the module is found through the worker's path (its directory) and the
    subprocess's own error comes back in one line; this process never imports it."""
    (tmp_path / "steady_loop_3b1.py").write_text("x = 1\n")
    spec = JobSpec(name="j", entrypoint="steady_loop_3b1:main", total_steps=1)
    why = entrypoint_refusal(spec, None, {"PATH": "/usr/bin:/bin"}, tmp_path)
    assert why is not None and "\n" not in why
    assert "AttributeError: module 'steady_loop_3b1' (" in why and "has no attribute 'main'" in why
    assert why.startswith("entrypoint 'steady_loop_3b1:main' does not import as a local worker would")
    assert "steady_loop_3b1" not in sys.modules
    assert entrypoint_refusal(JobSpec(name="j", recipe="digits", total_steps=1), None, {}, tmp_path) is None


@pytest.mark.parametrize(
    ("why", "fix"),
    [
        ("ModuleNotFoundError: No module named 'mypkg'", "run from the directory that holds mypkg (or add"),
        ("ModuleNotFoundError: No module named 'mypkg.train'", "run from the directory that holds mypkg"),
        ("ModuleNotFoundError: No module named 'transformers.x'", "install transformers for mypkg.train in"),
        ("AttributeError: module 'mypkg.train' (/p/train.py) has no attribute 'main'", "the function's name"),
        ("TypeError: mypkg.train.main (/p/train.py) is a int, not a function", "the function's name"),
        ("SyntaxError: invalid syntax (train.py, line 3)", "fix mypkg.train (or what it imports)"),
    ],
)
def test_what_to_do_about_a_failed_import(why: str, fix: str) -> None:
    assert fix in import_fix("mypkg.train:main", why)
