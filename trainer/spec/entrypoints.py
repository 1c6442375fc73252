"""A job's own training loop, named as `entrypoint: package.module:function`: its form, and how the trainer
finds and calls it.

The job file names the code a job runs one way only (`recipe` or `entrypoint`, and later `command`): the
spec's validator refuses both and neither with `code_problem`. Nothing here imports user code except
`resolve_entrypoint`, which the trainer calls on the worker; `spotrun run` imports the module in a
subprocess instead (tasks/admission/entrypoint_check.py), so the controller never loads user code or torch.

spotrun's own code is all under the `spotrun` package, so a loop's modules may have any other names
(`trainer.py`, `tasks/`, `utils.py` beside it): they are imported as Python would, from the directory the
worker starts in.
"""

from __future__ import annotations

import importlib
import inspect
import re
from collections.abc import Callable, Mapping
from typing import Any

from spotrun.trainer.errors import ConfigError
from spotrun.trainer.spec.templating import uses_templates

_NAME = r"[A-Za-z_][A-Za-z0-9_]*"
ENTRYPOINT = re.compile(rf"^{_NAME}(\.{_NAME})*:{_NAME}$")
# What each way in is, for the message that asks for one of them (the order is CODE_FIELDS' in the spec).
WAYS_IN = {
    "recipe": "recipe: digits, charlm or package.module:function (a build(args, ctx) returning Parts)",
    "entrypoint": "entrypoint: package.module:function (your own loop using spotrun.session())",
    "command": "command: [python, train.py, ...] (an unchanged script; its checkpoints in {checkpoint_dir})",
}


def entrypoint_problem(value: str) -> str | None:
    """Why `value` is not an entry point's `package.module:function` (None: it is)."""
    module = value.partition(":")[0]
    if ENTRYPOINT.match(value) and not module.endswith(".py"):  # a module named py: a file name, surely
        return None
    if module.endswith(".py") or "/" in module:
        dotted = module.removesuffix(".py").strip("./").replace("/", ".")
        return f"{value!r} names a file: use the module as you would import it, e.g. '{dotted}:main'"
    return f"{value!r} is not package.module:function: write e.g. 'mypkg.train:main' (module:function)"


def code_problem(given: Mapping[str, bool]) -> str | None:
    """Why the code fields (field -> set or not, in the spec's order) do not name exactly one way in."""
    named = [k for k, v in given.items() if v]
    if len(named) == 1:
        return None
    if not named:
        ways = "; or ".join(WAYS_IN.get(k, k) for k in given)
        return f"name the code to run: add {ways}"
    return f"{' and '.join(named)} are exclusive (one way in per job): keep one and remove the other"


def command_problem(argv: list[str]) -> str | None:
    """Why `argv` is not a command a job can run (None: it is): a program and its arguments, each
    placeholder one the worker fills (COMMAND_PLACEHOLDERS) or a run key's."""

    if not argv or not argv[0].strip():
        return "command is empty: give the program and its arguments, e.g. [python, train.py]"
    for i, arg in enumerate(argv):
        try:
            uses_templates(arg, f"command[{i}]")  # one vocabulary: a command's own names and a run key's
        except ConfigError as e:
            return str(e)
    return None


def split_entrypoint(entrypoint: str) -> tuple[str, str]:
    """`package.module:function` as (module, function)."""
    module, _, function = entrypoint.partition(":")
    return module, function


def resolve_entrypoint(entrypoint: str) -> Callable[..., Any]:
    """Import an entry point's module and return its function; ConfigError (one line) when the module is
    missing or holds no such function. Any other error raised by the module's import is its own bug."""
    module, function = split_entrypoint(entrypoint)
    try:
        mod = importlib.import_module(module)
    except ImportError as e:
        raise ConfigError(
            f"entrypoint {entrypoint!r}: cannot import {module!r} ({type(e).__name__}: {e}); run from the "
            "directory that holds it, add it to PYTHONPATH, or install it"
        ) from None
    fn = getattr(mod, function, None)
    if not callable(fn):
        raise ConfigError(
            f"entrypoint {entrypoint!r}: {module} ({getattr(mod, '__file__', None)}) has no function "
            f"{function!r}; fix the name after the colon"
        )
    return fn  # type: ignore[no-any-return]


def takes_args(fn: Callable[..., Any], entrypoint: str) -> bool:
    """Whether the entry point is called as `main(args)` (it takes an argument) or `main()`; ConfigError
    when it needs more than one, or a keyword."""
    P = inspect.Parameter
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):  # no signature to read (a builtin): give it the args
        return True
    required = [p for p in params if p.default is P.empty and p.kind not in (P.VAR_POSITIONAL, P.VAR_KEYWORD)]
    if len(required) > 1 or any(p.kind is P.KEYWORD_ONLY for p in required):
        names = ", ".join(p.name for p in required)
        raise ConfigError(
            f"entrypoint {entrypoint!r} must take no argument or one (the job's args), not ({names})"
        )
    return any(p.kind in (P.POSITIONAL_ONLY, P.POSITIONAL_OR_KEYWORD, P.VAR_POSITIONAL) for p in params)


def call_main(fn: Callable[..., Any], args: dict[str, Any], entrypoint: str) -> Any:
    """Call the entry point: `main(args)` when it takes an argument, else `main()`."""
    return fn(args) if takes_args(fn, entrypoint) else fn()
