"""The one rule for a file name read from a store: a plain relative name inside its step directory.

A manifest (or DCP's index) comes from a bucket that someone else may write, and its names become
local paths: `cache / name` with `name = "/etc/cron.d/x"` is `/etc/cron.d/x`, and `../../..` climbs out
of the cache (both wrote files outside any cache before this rule, through `spotrun checkpoints list`).
So every name is checked before anything of its manifest is fetched, and the joined path is checked
again where it is opened (`contained`).

A name: at most `MAX_DEPTH` components joined by `/`, each of letters, digits and `_.-=` (HF's
`checkpoint-100/`, Lightning's `epoch=0-step=100.ckpt` fit), none of them `.` or `..`; no absolute
path, no backslash, no NUL, bounded lengths.
"""

from __future__ import annotations

import re
from pathlib import Path

MAX_DEPTH = 4
MAX_COMPONENT = 128
MAX_NAME = 255
_COMPONENT = re.compile(r"[A-Za-z0-9_.=-]+")


def name_problem(name: object) -> str | None:
    """Why `name` is not a plain relative file name inside a step directory; None when it is."""
    if not isinstance(name, str) or not name:
        return f"file name {name!r} is empty or not a string"
    shown = repr(name[:60] + ("..." if len(name) > 60 else ""))
    if len(name) > MAX_NAME:
        return f"file name {shown} is longer than {MAX_NAME} characters"
    if name.startswith("/"):
        return f"file name {shown} is an absolute path"
    parts = name.split("/")
    if len(parts) > MAX_DEPTH:
        return f"file name {shown} is deeper than {MAX_DEPTH} components"
    for part in parts:
        if part in ("", ".", ".."):
            return f"file name {shown} has an empty, '.' or '..' component"
        if len(part) > MAX_COMPONENT or not _COMPONENT.fullmatch(part):
            return f"file name {shown} has characters outside letters, digits and '_.-='"
    return None


def contained(root: Path, name: str) -> Path:
    """`root / name`, refused (ValueError) unless it is a plain name that resolves inside `root`."""
    problem = name_problem(name)
    if problem is not None:
        raise ValueError(problem)
    base = root.resolve()
    target = (base / name).resolve()
    if base not in target.parents:
        raise ValueError(f"file name {name!r} resolves outside {root}")
    return target
