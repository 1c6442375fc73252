"""A job's entry point (trainer/spec/entrypoints.py, tasks/admission/entrypoint_check.py): its form, the
modules beside it that would clash with spotrun's packages, how it is called, and `spotrun run`'s import check
in a subprocess (one real one)."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from spotrun.tasks.admission.entrypoint_check import entrypoint_refusal, import_fix, spotrun_root, worker_path
from spotrun.trainer.errors import ConfigError
from spotrun.trainer.spec.entrypoints import (
    call_main,
    code_problem,
    entrypoint_problem,
    module_root,
    resolve_entrypoint,
    shadowing_problem,
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


def tree(root: Path, *files: str) -> Path:
    """Files (and their directories) under `root`, empty."""
    for f in files:
        (root / f).parent.mkdir(parents=True, exist_ok=True)
        (root / f).write_text("")
    return root


def test_module_root_is_where_the_import_system_finds_the_top_package(tmp_path: Path) -> None:
    a = tree(tmp_path / "a", "mypkg/train.py", "solo/x.py")  # two namespace directories
    b = tree(tmp_path / "b", "mypkg/__init__.py", "train.py")
    c = tree(tmp_path / "c", "solo/y.py")
    assert module_root("mypkg.train", [a, b]) == b  # a regular package wins over an earlier namespace
    assert module_root("train", [a, b]) == b  # a plain module
    assert module_root("solo.x", [a, c]) == a  # namespace portions only: the first
    assert module_root("installed.mod", [a, b]) is None


OURS = Path("/opt/spotrun")  # where spotrun's packages live in these cases


@pytest.mark.parametrize(
    ("files", "entrypoint", "problem"),
    [
        (["mypkg/__init__.py", "mypkg/train.py"], "mypkg.train:main", None),
        (["mypkg/__init__.py", "trainer.py"], "mypkg.train:main", "trainer.py has the name of spotrun's own"),
        (
            ["train.py", "tasks/__init__.py"],
            "train:main",
            "tasks has the name of spotrun's own package 'tasks'",
        ),
        (["train.py", "spotrun/__init__.py"], "train:main", "rename it (e.g. my_spotrun) and its imports"),
        (["flows/__init__.py", "flows/loop.py"], "flows.loop:main", "flows has the name"),  # itself
        (["train.py", "deployments/prefect.yaml"], "train:main", None),  # a plain directory: no module
        (["elsewhere.py", "trainer.py"], "installed.loop:main", None),  # not from this directory
    ],
)
def test_a_module_named_like_spotruns_packages_beside_the_loop_is_refused(
    tmp_path: Path, files: list[str], entrypoint: str, problem: str | None
) -> None:
    root = tree(tmp_path, *files)
    got = shadowing_problem(entrypoint, [root], OURS)
    assert got is None if problem is None else (got is not None and problem in got and "\n" not in got)


def test_a_loop_kept_in_spotruns_own_tree_clashes_with_nothing(tmp_path: Path) -> None:
    root = tree(tmp_path, "trainer/__init__.py", "examples/__init__.py", "examples/loop.py")
    assert shadowing_problem("examples.loop:main", [root], root) is None


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


def test_the_worker_path_is_spotrun_then_its_directory_then_pythonpath(tmp_path: Path) -> None:
    """spotrun's root first: a trainer.py in the worker's directory cannot shadow spotrun's trainer."""
    ours = spotrun_root()
    assert (ours / "trainer" / "__init__.py").is_file()
    assert worker_path(tmp_path, f"/x{os.pathsep}/y", ours) == [str(ours), str(tmp_path), "/x", "/y"]
    assert worker_path(tmp_path, None, ours) == [str(ours), str(tmp_path)]
    assert worker_path(ours, f"{ours}{os.pathsep}{os.pathsep}/x") == [str(ours), "/x"]  # each once


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
