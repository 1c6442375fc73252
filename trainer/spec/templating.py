"""The one templating function for every `{name}` placeholder in a job: run keys, recipe args.

One vocabulary for all of them (`VOCABULARY`), `{{` and `}}` as the escapes, and an unknown or
malformed placeholder refused in one line that lists the names there are. No format specs, no
attribute access, no indexing: `str.format` would let a form reach `{x.__class__}`; this never
evaluates anything, it only substitutes plain strings.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from typing import Any

from spotrun.trainer.errors import ConfigError

# name: what it is. The first four are filled by the controller from the flow run that starts a key
# (tasks/retraining/run_keys.py).
VOCABULARY = {
    "scheduled_date": "the slot's date, YYYY-MM-DD, in the schedule's timezone (else UTC)",
    "scheduled_time": "the slot's time, YYYYMMDDTHHMMSS, in the same timezone",
    "flow_run_name": "the name of the key's first flow run",
    "run_key": "the run key itself (for recipe args)",
    # Filled by the worker in a `command:` (trainer/command/runner.py).
    "checkpoint_dir": "the directory the command writes its checkpoints in, restored before the start",
    "step": "the step the command resumes from (0 on a first start)",
    "world_size": "processes in the job (1)",
    "total_steps": "the job file's total_steps",
    "python": "the worker's own Python interpreter, the one spotrun runs in (a bare `python` is PATH's)",
}
_TOKEN = re.compile(r"\{\{|\}\}|\{([^{}]*)\}|[{}]")


def pieces(text: str, where: str = "template") -> list[tuple[str, str]]:
    """`text` as ("text", literal) and ("name", placeholder) pieces, escapes undone."""
    return list(_tokens(text, where))


def placeholders(text: str) -> list[str]:
    """The names `text` uses, in order (ConfigError for one outside the vocabulary)."""
    return [name for kind, name in _tokens(text, "") if kind == "name"]


def fill(text: str, values: Mapping[str, str], where: str = "template") -> str:
    """`text` with each `{name}` replaced by `values[name]`; `{{`/`}}` stand for literal braces.

    ConfigError (one line naming `where`) for an unknown name, a stray brace, or a name with no value."""
    out = []
    for kind, piece in _tokens(text, where):
        if kind == "text":
            out.append(piece)
        elif piece not in values:
            raise ConfigError(f"{where}: {{{piece}}} has no value here; use only {_names(values)}")
        else:
            out.append(values[piece])
    return "".join(out)


def fill_tree(obj: Any, values: Mapping[str, str], where: str) -> Any:
    """`fill` applied to every string in a JSON-like tree (dict keys are left as they are)."""
    if isinstance(obj, str):
        return fill(obj, values, where)
    if isinstance(obj, dict):
        return {k: fill_tree(v, values, f"{where}.{k}") for k, v in obj.items()}
    if isinstance(obj, list):
        return [fill_tree(v, values, f"{where}[{i}]") for i, v in enumerate(obj)]
    return obj


def uses_templates(obj: Any, where: str = "") -> bool:
    """Whether any string in a JSON-like tree holds a placeholder (escapes do not count); ConfigError
    naming the place (`where` and below) for an unknown one."""
    if isinstance(obj, str):
        return any(kind == "name" for kind, _ in _tokens(obj, where))
    if isinstance(obj, dict):
        return any([uses_templates(v, f"{where}.{k}") for k, v in obj.items()])
    if isinstance(obj, list):
        return any([uses_templates(v, f"{where}[{i}]") for i, v in enumerate(obj)])
    return False


def _tokens(text: str, where: str) -> Iterator[tuple[str, str]]:
    pos = 0
    for m in _TOKEN.finditer(text):
        if m.start() > pos:
            yield "text", text[pos : m.start()]
        pos = m.end()
        tok = m.group(0)
        if tok in ("{{", "}}"):
            yield "text", tok[0]
        elif tok in ("{", "}"):
            raise ConfigError(
                f"{where or 'template'}: a stray {tok!r} in {text!r}; write {tok * 2} for a literal brace"
            )
        else:
            name = m.group(1)
            if name not in VOCABULARY:
                raise ConfigError(
                    f"{where or 'template'}: unknown placeholder {{{name}}} in {text!r}; use "
                    f"{_names(VOCABULARY)} (or {{{{ }}}} for literal braces)"
                )
            yield "name", name
    if pos < len(text):
        yield "text", text[pos:]


def _names(values: Mapping[str, Any]) -> str:
    return ", ".join(f"{{{n}}}" for n in values)
