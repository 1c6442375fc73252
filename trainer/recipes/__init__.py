"""Recipes build the parts of a training job. Built in: digits, charlm; users name `pkg.module:function`.

A recipe is `build(args: dict, ctx: RecipeContext) -> Parts`. It must build model, optimizer and
scheduler in that order and draw all its data randomness from `ctx.seed` (see trainer/data.py):
that is what makes resume bitwise exact.

State a recipe keeps beyond the model, optimizer and scheduler (an EMA of the weights, a streaming
dataset's cursor) goes in `Parts.extra_state`: name -> anything with `state_dict()` and
`load_state_dict()`. Each is saved as `extra.<name>.pt` with every checkpoint, checked for NaN/Inf,
and loaded back on resume; it must load with `torch.load(weights_only=True)` (tensors, numbers,
strings, lists, tuples and dicts). The names are part of the job: resuming a checkpoint that lacks
one, or holds one the recipe no longer returns, is refused with the name.
"""

from __future__ import annotations

import importlib
import inspect
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils.data import Dataset

from trainer.errors import ConfigError
from trainer.stateful import Stateful

LossFn = Callable[[torch.nn.Module, Any], torch.Tensor]


@dataclass(frozen=True)
class RecipeContext:
    seed: int
    total_steps: int
    batch_size: int
    device: torch.device


@dataclass
class Parts:
    """What a recipe returns. `dataset` may define `set_epoch(epoch)` for epoch-dependent augmentation;
    `extra_state` holds the recipe's own checkpointed parts (see the module docstring)."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    dataset: Dataset[Any]
    loss_fn: LossFn
    grad_clip: float | None = 1.0
    extra_state: dict[str, Stateful] = field(default_factory=dict)


BUILTIN = {
    "digits": "trainer.recipes.digits:build",
    "charlm": "trainer.recipes.charlm:build",
}

Recipe = Callable[[dict[str, Any], RecipeContext], Parts]


def resolve(name: str) -> Recipe:
    """Find a recipe by built-in name or `package.module:function`."""
    target = BUILTIN.get(name, name)
    if ":" not in target:
        raise ConfigError(
            f"unknown recipe {name!r}: use one of {sorted(BUILTIN)} or 'package.module:function'"
        )
    mod_name, _, fn_name = target.partition(":")
    try:
        mod = importlib.import_module(mod_name)
    except ImportError as e:
        raise ConfigError(
            f"recipe {name!r}: cannot import module {mod_name!r} ({e}); is it installed?"
        ) from None
    fn = getattr(mod, fn_name, None)
    if not callable(fn):
        raise ConfigError(f"recipe {name!r}: {mod_name} has no function {fn_name!r}")
    return fn  # type: ignore[no-any-return]


def build(name: str, args: dict[str, Any], ctx: RecipeContext) -> Parts:
    """Resolve and call a recipe. Whatever stops it from building is the job file's to fix: a
    ConfigError naming the recipe, its args and the error (the trainer exits CONFIG_ERROR, not retried)."""
    fn = resolve(name)
    try:
        inspect.signature(fn).bind(args, ctx)
    except TypeError as e:
        raise ConfigError(f"recipe {name!r} must take (args, ctx): {e}") from None
    try:
        parts = fn(args, ctx)
    except ConfigError:
        raise  # already one line that says what to fix
    except OSError:
        raise  # a dataset download or a disk that failed: may pass on retry, so not the job file's fault
    except Exception as e:  # the recipe's own checks, torch's (nn.Linear(64, -4)): the args are wrong
        raise ConfigError(
            f"recipe {name!r} could not be built with args {json.dumps(args, default=str)}: "
            f"{type(e).__name__}: {_first_line(e)}; fix args in the job file"
        ) from None
    if not isinstance(parts, Parts):
        raise ConfigError(f"recipe {name!r} returned {type(parts).__name__}, expected trainer.recipes.Parts")
    return parts


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0][:300] if text else "(no message)"


def warmup_cosine(total_steps: int, warmup: int) -> Callable[[int], float]:
    """LR multiplier as a pure function of the step: linear warm-up, then cosine to zero."""
    import math

    def f(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, total_steps - warmup)))

    return f
