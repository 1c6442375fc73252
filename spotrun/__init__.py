"""spotrun: fault-tolerant training on spot GPUs.

What a user's code imports, all of it from here (pinned by tests/unit/test_public_api.py):

- your own loop (`entrypoint:` in the job file, docs/your-loop.md): `spotrun.session(model=...,
  optimizer=...)` makes it resumable; `SessionEnded` is what a block left after a stop raises;
- a recipe (`recipe:`, docs/recipes.md): `Parts`, `RecipeContext`, the `@recipe` decorator, `arg`,
  `evaluating`, `sample_generator` for data randomness and the learning-rate schedule `warmup_cosine`;
- `ConfigError`: raise it with what to change, for one line and exit code 2 instead of a traceback.

An unchanged Transformers or Lightning script imports its callback from `spotrun.integrations.transformers`
or `spotrun.integrations.lightning`. Everything else under `spotrun.` is internal and moves without
notice. Names are loaded when first read: `spotrun --help` imports neither torch nor Prefect.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from spotrun.trainer.errors import ConfigError as ConfigError
    from spotrun.trainer.recipes import Parts as Parts
    from spotrun.trainer.recipes import RecipeContext as RecipeContext
    from spotrun.trainer.recipes import arg as arg
    from spotrun.trainer.recipes import evaluating as evaluating
    from spotrun.trainer.recipes import recipe as recipe
    from spotrun.trainer.recipes import warmup_cosine as warmup_cosine
    from spotrun.trainer.recipes.data import sample_generator as sample_generator
    from spotrun.trainer.session.context import SessionEnded as SessionEnded
    from spotrun.trainer.session.context import session as session

# name: the module that defines it (imported when the name is first read)
_WHERE = {
    "ConfigError": "spotrun.trainer.errors",
    "Parts": "spotrun.trainer.recipes",
    "RecipeContext": "spotrun.trainer.recipes",
    "SessionEnded": "spotrun.trainer.session.context",
    "arg": "spotrun.trainer.recipes",
    "evaluating": "spotrun.trainer.recipes",
    "recipe": "spotrun.trainer.recipes",
    "sample_generator": "spotrun.trainer.recipes.data",
    "session": "spotrun.trainer.session.context",
    "warmup_cosine": "spotrun.trainer.recipes",
}
__all__ = ["__version__", *sorted(_WHERE)]


def __getattr__(name: str) -> Any:
    if name == "__version__":  # read when asked: every worker process imports this package at start
        from spotrun.trainer.interpreter import spotrun_version

        return spotrun_version()
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'spotrun' has no attribute {name!r}")
    return getattr(import_module(module), name)


def __dir__() -> list[str]:
    return sorted({*globals(), *_WHERE, "__version__"})
