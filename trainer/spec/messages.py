"""A job file's validation errors as the one line a user reads: the most useful error first.

pydantic reports a misspelt key as two errors (an unknown key, a missing field) with the missing one
first; shown alone, it hides the typo. `explain_errors` names the key with the field it likely meant.
"""

from __future__ import annotations

from collections.abc import Sequence
from difflib import get_close_matches
from typing import Any, get_args

from pydantic import BaseModel
from pydantic_core import ErrorDetails

Loc = tuple[int | str, ...]  # where an error is: ("checkpoint", "keep")


def explain_errors(errors: Sequence[ErrorDetails], model: type[BaseModel], data: Any) -> str:
    """pydantic's errors about `data` (for `model`) as one line, the most useful error first.

    A misspelt key is two errors to pydantic, an unknown key and a missing field, and the missing one
    comes first: shown alone it hides the typo. So an unknown key comes first, named with the field it
    likely meant (a missing one at the same place, else one not given there), counted once with it.
    """
    missing = [e["loc"] for e in errors if e["type"] == "missing"]
    guesses = [_guess(e, missing, model, data) for e in errors]

    def rank(i: int) -> tuple[int, int]:  # a typo of a missing field, a guessed key, a key, the rest
        e, g = errors[i], guesses[i]
        if e["type"] != "extra_forbidden":
            return (3, i)
        if g is None:
            return (2, i)
        return (0 if (*e["loc"][:-1], g) in missing else 1, i)

    best = min(range(len(errors)), key=rank)
    err, guess = errors[best], guesses[best]
    # A missing field some unknown key likely meant is that key's problem, not one more.
    typos = {(*e["loc"][:-1], g) for e, g in zip(errors, guesses, strict=True) if g is not None}
    others = len(errors) - len(typos & set(missing)) - 1
    more = f" (+{others} more)" if others else ""
    return (_plain(err) if guess is None else _misspelt(err["loc"], guess)) + more


def _guess(err: ErrorDetails, missing: list[Loc], model: type[BaseModel], data: Any) -> str | None:
    """The field an unknown key likely meant: a missing one beside it, else one not given there."""
    if err["type"] != "extra_forbidden":
        return None
    parent, key = err["loc"][:-1], str(err["loc"][-1])
    lost = [str(loc[-1]) for loc in missing if loc[:-1] == parent]
    hits = get_close_matches(key, lost, n=1) or get_close_matches(key, _unset(model, data, parent), n=1)
    return hits[0] if hits else None


def _unset(model: type[BaseModel], data: Any, loc: Loc) -> list[str]:
    """The keys (aliases where a field has one) of the model at `loc` that `data` does not give."""
    for part in loc:
        field = model.model_fields.get(str(part)) or next(
            (f for f in model.model_fields.values() if f.alias == part), None
        )
        inner = _model_in(field.annotation) if field is not None else None
        if inner is None:
            return []
        model, data = inner, data.get(part) if isinstance(data, dict) else None
    given = set(data) if isinstance(data, dict) else set()
    keys = [(f.alias or name, name) for name, f in model.model_fields.items()]
    return [key for key, name in keys if key not in given and name not in given]


def _model_in(annotation: Any) -> type[BaseModel] | None:
    """The model in `annotation` (`CheckpointPolicy`, `DistributedOptions | None`), if any."""
    for t in (annotation, *get_args(annotation)):
        if isinstance(t, type) and issubclass(t, BaseModel):
            return t
    return None


def _misspelt(loc: Loc, guess: str) -> str:
    parent = ".".join(str(p) for p in loc[:-1])
    where = f"a field of '{parent}'" if parent else "a job field"
    return f"field '{_dotted(loc)}' is not {where}: did you mean '{guess}'? (rename it in the job file)"


def _plain(err: ErrorDetails) -> str:
    hint = {
        "missing": " - add it to the job file",
        "extra_forbidden": " - remove it or check its spelling",
    }.get(err["type"], "")
    msg = err["msg"].removeprefix("Value error, ")
    return f"field '{_dotted(err['loc'])}': {msg}{hint}" if err["loc"] else f"{msg}{hint}"


def _dotted(loc: Loc) -> str:
    return ".".join(str(p) for p in loc) or "(top level)"
