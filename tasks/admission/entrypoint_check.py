"""Whether a job's entry point can run on a local worker, checked before a server starts (`spotrun run`).

The controller never imports user code, torch or transformers: the module is imported in a separate
`python -P` (the worker's interpreter, environment and path), which reports one line back. Its top-level
code runs there, as it would on the worker. EC2 workers are not checked: their image may hold what this
machine lacks.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from spotrun.tasks.providers.trainer_env import trainer_env
from spotrun.trainer.interpreter import SAFE_PATH, worker_path
from spotrun.trainer.spec.entrypoints import split_entrypoint
from spotrun.trainer.spec.job import JobSpec

CHECK_TIMEOUT_S = 120.0  # the module's imports (torch: 1-5 s) and its top-level code
_MARK = "spotrun-entrypoint-check: "  # the check's own line among whatever the module prints
# Run as `python -P -c _CHECK MARK MODULE FUNCTION`: -P keeps the working directory off sys.path, so the
# path is exactly PYTHONPATH's, a local worker's (trainer/interpreter.py `worker_path`: the working
# directory, then PYTHONPATH's entries), as a worker started with `python -P -m spotrun.trainer` has it.
_CHECK = """\
import importlib, sys
mark, module, function = sys.argv[1:4]
def say(line):
    sys.__stdout__.write(mark + " ".join(line.split())[:400] + "\\n")
    sys.__stdout__.flush()
try:
    mod = importlib.import_module(module)
except BaseException as e:
    text = str(e).strip().splitlines()
    say(f"{type(e).__name__}: {text[0] if text else ''}")
    sys.exit(3)
where = getattr(mod, "__file__", None) or module
if not hasattr(mod, function):
    say(f"AttributeError: module {module!r} ({where}) has no attribute {function!r}")
    sys.exit(3)
kind = type(getattr(mod, function)).__name__
if not callable(getattr(mod, function)):
    say(f"TypeError: {module}.{function} ({where}) is a {kind}, not a function")
    sys.exit(3)
say("ok")
"""


def import_problem(
    entrypoint: str,
    python: str,
    path: Sequence[str],
    *,
    env: Mapping[str, str],
    cwd: Path,
    timeout_s: float = CHECK_TIMEOUT_S,
) -> str | None:
    """Import the entry point's module in a subprocess and check its function is callable: the
    subprocess's one line (`ModuleNotFoundError: No module named 'x'`, `AttributeError: ...`), or None."""
    module, function = split_entrypoint(entrypoint)
    cmd = [python, SAFE_PATH, "-c", _CHECK, _MARK, module, function]
    child_env = {**env, "PYTHONPATH": os.pathsep.join(path)}
    try:
        done = subprocess.run(
            cmd,
            cwd=cwd,
            env=child_env,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            errors="replace",
            timeout=timeout_s,
        )
    except subprocess.TimeoutExpired:
        return (
            f"importing {module} took over {timeout_s:g} s (does it train at import? keep it in {function})"
        )
    except OSError as e:
        return f"cannot start {python}: {e.strerror}"
    said = [line.removeprefix(_MARK) for line in done.stdout.splitlines() if line.startswith(_MARK)]
    if said == ["ok"] and done.returncode == 0:
        return None
    if said:
        return said[-1]
    tail = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
    return f"the import check exited with code {done.returncode}: {tail[:300]}"


def entrypoint_refusal(
    spec: JobSpec, python: str | None, environ: Mapping[str, str], cwd: Path
) -> str | None:
    """Why a local job's entry point cannot run, in one line (None: it imports, or the job has none): the
    import's own error. `python`: the provider's interpreter (None: this one); `environ`: what the
    trainer environment is drawn from."""
    if spec.entrypoint is None:
        return None
    env = trainer_env(environ, spec.env)
    path = worker_path(cwd, env.get("PYTHONPATH"))
    interpreter = python or sys.executable
    why = import_problem(spec.entrypoint, interpreter, path, env=env, cwd=cwd)
    if why is None:
        return None
    where = f"entrypoint {spec.entrypoint!r} does not import as a local worker would ({interpreter} in {cwd})"
    return f"{where}: {why}; {import_fix(spec.entrypoint, why)}"


def import_fix(entrypoint: str, why: str) -> str:
    """What to do about the import check's line `why`."""
    module, function = split_entrypoint(entrypoint)
    if why.endswith((f"has no attribute {function!r}", "not a function")):  # the check's own two lines
        return "fix the function's name after the colon"
    missing = re.match(r"ModuleNotFoundError: No module named '([^']+)'", why)
    if missing and f"{module}.".startswith(f"{missing[1]}."):  # the entry point's own module or package
        top = module.partition(".")[0]
        return f"fix the name, or run from the directory that holds {top} (or add it to PYTHONPATH)"
    if missing:
        return f"install {missing[1].partition('.')[0]} for {module} in the workers' interpreter"
    return f"fix {module} (or what it imports): a worker's import fails the same way"
