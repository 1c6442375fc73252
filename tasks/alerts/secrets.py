"""Slack settings from Prefect Secret blocks: the one module of tasks/alerts that imports Prefect."""

from __future__ import annotations

from typing import Any, cast

from prefect.blocks.system import Secret
from prefect.exceptions import ObjectNotFound


def prefect_secret(name: str) -> str | None:
    """The value of the Prefect Secret block `name`; None when no such block exists."""
    try:
        # _sync: the value, not a coroutine, also when called from async code
        block = cast(Secret[Any], Secret.load(name, _sync=True))  # type: ignore[call-arg]
    except ObjectNotFound:
        return None
    except ValueError as e:  # Block.load turns ObjectNotFound into ValueError; anything else is real
        if isinstance(e.__cause__, ObjectNotFound):
            return None
        raise
    value = block.get()
    return value if isinstance(value, str) else str(value)
