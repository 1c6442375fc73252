"""How spotrun starts a Python process of its own: `python -P -m MODULE ARGS`, in an explicit directory,
with that directory on the import path as Python would put it.

spotrun installs one import package, `spotrun` (its rooms are `spotrun.trainer`, `spotrun.tasks`, ...),
so nothing of spotrun's can be shadowed by a user's module or shadow one: a project's own `trainer.py`,
`tasks/` or `flows/` beside its loop is the project's. `-P` (Python 3.11+) keeps a process's own working
directory off sys.path; a worker's PYTHONPATH (`worker_path`) names the directory it starts in first,
where a loop or a recipe kept beside the job file lives, then the environment's own entries: what
`python -m` in that directory would import. A fork server's children, whose sys.path is the server's,
get the same path by construction.

Every worker command (the local provider's, the fork server's, torchrun's and its ranks', the
checkpoint writer's, EC2's user data) is built with `python_m`, the one place that says `-P`.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from functools import cache
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

SAFE_PATH = "-P"  # the flag: no working directory (nor script directory) prepended to sys.path


def python_m(module: str, *args: str, python: str | None = None) -> list[str]:
    """The argv that runs `module` as `__main__` with `args`: `python -P -m module args...`;
    `python`: the interpreter (None: this one)."""
    return [python or sys.executable, SAFE_PATH, "-m", module, *args]


def worker_path(cwd: Path | str | None, pythonpath: str | None) -> list[str]:
    """A worker's import path, in order: the working directory `cwd` (absolute; None: none), then
    PYTHONPATH's own entries; each once, the first kept."""
    entries = [os.path.abspath(cwd)] if cwd is not None else []
    entries += [p for p in (pythonpath or "").split(os.pathsep) if p]
    return list(dict.fromkeys(entries))


def child_env(env: Mapping[str, str] | None = None, cwd: Path | str | None = None) -> dict[str, str]:
    """`env` (None: this process's) with PYTHONPATH made a worker's (`worker_path`): a process started with
    `python_m` in `cwd` imports what a `python -m` there would have found."""
    env = dict(os.environ if env is None else env)
    env["PYTHONPATH"] = os.pathsep.join(worker_path(cwd, env.get("PYTHONPATH")))
    return env


@cache
def spotrun_version() -> str:
    """The installed spotrun's version ("0+unknown" from a tree that was never installed): what a fork
    server that outlives a job (a pool) and an EC2 image must run, for a worker to be this code."""
    try:
        return version("spotrun")
    except PackageNotFoundError:
        return "0+unknown"
