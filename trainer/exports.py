"""A room's public names, imported on first use (PEP 562), so that naming a room costs nothing.

Every room (`trainer/checkpoint/`, `tasks/decisions/`, ...) re-exports the names the code outside it uses.
Importing them eagerly would make `trainer.checkpoint.catalog`, which the controller reads, pay for
`trainer.checkpoint.state`, which imports torch (the controller never loads torch: importing it cost
5.4 s of CPU instead of 2.1 s). So a room's `__init__` maps each name to its module, and the module is
imported when the name is first read; the same names are imported under `TYPE_CHECKING` for the checkers.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any


def lazy_exports(package: str, where: Mapping[str, str]) -> Callable[[str], Any]:
    """The `__getattr__` of `package`'s `__init__`: each name in `where` from `package.<module>`."""

    def __getattr__(name: str) -> Any:
        module = where.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(f"{package}.{module}"), name)

    return __getattr__
