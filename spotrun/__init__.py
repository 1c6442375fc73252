"""spotrun: fault-tolerant training on spot GPUs.

On a worker, `spotrun.session(model=..., optimizer=...)` makes a training loop of your own resumable
(docs/your-loop.md). Loaded lazily: `spotrun --help` imports neither torch nor Prefect.
"""

from __future__ import annotations

from typing import Any

__all__ = ["session"]


def __getattr__(name: str) -> Any:
    if name == "session":
        from spotrun.trainer.session import session

        return session
    raise AttributeError(f"module 'spotrun' has no attribute {name!r}")
