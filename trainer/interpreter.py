"""How spotrun starts a Python process of its own: `python -P -m MODULE ARGS`, in an explicit directory,
with spotrun's root first on PYTHONPATH.

`python -m` puts its working directory first on sys.path, so a user's own `trainer.py` (or `tasks/`,
`flows/`, ...) in the directory a worker starts from would be imported instead of spotrun's package. `-P`
(Python 3.11+) leaves the working directory off the path; what a process imports is then exactly
PYTHONPATH and the installed packages. A worker's PYTHONPATH (`worker_path`) names spotrun's root first,
then the working directory, where a user's loop or recipe kept beside the job file lives, then the
environment's own entries: spotrun's packages win over anything beside the loop, and the loop still
imports. A module named like one of spotrun's packages beside an entry point is refused before the job
starts (trainer/spec/entrypoints.py `shadowing_problem`), since the two cannot both be imported.

Every worker command (the local provider's, the fork server's, torchrun's and its ranks', the
checkpoint writer's, EC2's user data) is built with `python_m`, the one place that says `-P`.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from pathlib import Path

SAFE_PATH = "-P"  # the flag: no working directory (nor script directory) prepended to sys.path


def python_m(module: str, *args: str, python: str | None = None) -> list[str]:
    """The argv that runs `module` as `__main__` with `args`: `python -P -m module args...`;
    `python`: the interpreter (None: this one)."""
    return [python or sys.executable, SAFE_PATH, "-m", module, *args]


def spotrun_root() -> Path:
    """The directory that provides spotrun's own packages (trainer, tasks, flows, ...)."""
    return Path(__file__).resolve().parents[1]


def worker_path(cwd: Path | str | None, pythonpath: str | None, ours: Path | None = None) -> list[str]:
    """A worker's import path, in order: spotrun's root (`ours`, default `spotrun_root()`), the working
    directory `cwd` (absolute; None: none), then PYTHONPATH's own entries; each once, the first kept."""
    entries = [str(ours or spotrun_root())]
    if cwd is not None:
        entries.append(os.path.abspath(cwd))
    entries += [p for p in (pythonpath or "").split(os.pathsep) if p]
    return list(dict.fromkeys(entries))


def child_env(env: Mapping[str, str] | None = None, cwd: Path | str | None = None) -> dict[str, str]:
    """`env` (None: this process's) with PYTHONPATH made a worker's (`worker_path`): a process started with
    `python_m` in `cwd` imports spotrun's packages, and what a `python -m` there would have found."""
    env = dict(os.environ if env is None else env)
    env["PYTHONPATH"] = os.pathsep.join(worker_path(cwd, env.get("PYTHONPATH")))
    return env
