"""Recipes build the parts of a training job. Built in: digits, charlm; users name `pkg.module:function`.

A recipe is a function `build(args: dict, ctx: RecipeContext) -> Parts`; docs/recipes.md has the whole
contract and a complete example. In short, for resume to be bitwise exact:

- build the model, then the optimizer, then the scheduler: the trainer seeds the global RNGs with
  `ctx.seed` just before, so weight init is the same in every attempt;
- draw data randomness (augmentation, crops) from `trainer.recipes.data.sample_generator(seed, epoch, index)`
  and take the epoch from `dataset.set_epoch(epoch)`, never from the global RNG or a worker's;
- `Parts.scheduler` (optional) is stepped once per optimizer step, after `optimizer.step()`;
- the loader hands `loss_fn` one batch as the default collate makes it from `dataset[i]`, and drops
  the last partial batch of each epoch.

Validate args at the top of `build` and raise `ConfigError` or `ValueError` with what to change: the
trainer reports it in one line, exits CONFIG_ERROR (2) and is not retried. Any other exception is a
bug in the recipe and is reported with its traceback.

Declare which args shape the state with `@recipe(shape_args=...)`: changing one of them makes a
checkpoint unloadable (refused), while changing any other arg (a learning rate) is a change of
trajectory, accepted with `resume.allow_changes`. A recipe that declares nothing has every arg shape.

State a recipe keeps beyond the model, optimizer and scheduler (an EMA of the weights, a streaming
dataset's cursor) goes in `Parts.extra_state`: name -> anything with `state_dict()` and
`load_state_dict()`. Each is saved as `extra.<name>.pt` with every checkpoint, checked for NaN/Inf,
and loaded back on resume; it must load with `torch.load(weights_only=True)` (tensors, numbers,
strings, lists, tuples and dicts). The names are part of the job: resuming a checkpoint that lacks
one, or holds one the recipe no longer returns, is refused with the name.

`Parts.evaluate(model) -> {metric: value}` (optional) measures a model on held-out data of this run's
(a few batches, deterministic: no augmentation, no draws from the global RNG). A job with `promote`
calls it at completion on the final model and on the champion's, on the same data, and records both
in COMPLETED.json (trainer/session/evaluation.py); the promotion gate compares `promote.metric`. Wrap it in
`with evaluating(model):` (no gradients, eval mode, the model's mode restored after).
"""

from __future__ import annotations

import importlib
import inspect
import json
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from difflib import get_close_matches
from typing import Any, TypeVar

import torch
from torch.utils.data import Dataset

from spotrun.trainer.checkpoint.stateful import Stateful
from spotrun.trainer.errors import ConfigError

LossFn = Callable[[torch.nn.Module, Any], torch.Tensor]
Evaluate = Callable[[torch.nn.Module], dict[str, float]]


@dataclass(frozen=True)
class RecipeContext:
    seed: int
    total_steps: int
    batch_size: int
    device: torch.device


@dataclass
class Parts:
    """What a recipe returns.

    `scheduler`: stepped once per optimizer step, after it; None keeps the optimizer's lr. `dataset`:
    a map-style dataset; it may define `set_epoch(epoch)` for epoch-dependent augmentation. `loss_fn(model,
    batch)`: `batch` is what the default collate makes of `batch_size` items. `grad_clip`: clip the
    gradients' global norm to this before each step; None (the default) leaves them as they are.
    `extra_state`: the recipe's own checkpointed parts (see the module docstring). `evaluate`:
    evaluation metrics on this run's held-out data (see the module docstring); None: the recipe has none."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler | None
    dataset: Dataset[Any]
    loss_fn: LossFn
    grad_clip: float | None = None
    extra_state: dict[str, Stateful] = field(default_factory=dict)
    evaluate: Evaluate | None = None


@contextmanager
def evaluating(model: torch.nn.Module) -> Iterator[torch.nn.Module]:
    """No gradients and eval mode (dropout off) inside; the model's own mode (per module) restored after."""
    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        with torch.no_grad():
            yield model
    finally:
        for m, training in modes:
            m.training = training


_F = TypeVar("_F", bound=Callable[..., Any])


def recipe(*, shape_args: Iterable[str], args: Iterable[str] | None = None) -> Callable[[_F], _F]:
    """Declare which of a recipe's args shape its state (model and optimizer structure): a checkpoint
    made with other values for them cannot be loaded. Every other arg only changes the trajectory.
    `args`: every arg the recipe takes; then an unknown one in a job file is refused before anything
    starts (`check_args`: `spotrun run` checks it before a server or a worker), with the one it likely
    meant."""
    declared = frozenset(shape_args)
    takes = frozenset(args) if args is not None else None

    def mark(fn: _F) -> _F:
        fn.shape_args = declared  # type: ignore[attr-defined]
        fn.takes = takes  # type: ignore[attr-defined]
        return fn

    return mark


def check_args(name: str, given: Mapping[str, Any]) -> None:
    """ConfigError for an arg recipe `name` does not take, when it declares what it takes."""
    takes: frozenset[str] | None = getattr(resolve(name), "takes", None)
    if takes is None:  # declares nothing: its own checks in build
        return
    unknown = sorted(set(given) - takes)
    if not unknown:
        return
    key = unknown[0]
    close = get_close_matches(key, sorted(takes - set(given)), n=1)
    hint = f"did you mean {close[0]!r}?" if close else f"{name} takes {sorted(takes)}"
    more = f" (and {', '.join(map(repr, unknown[1:]))})" if len(unknown) > 1 else ""
    raise ConfigError(f"recipe {name!r} has no argument {key!r}{more}: {hint} (fix args in the job file)")


_T = TypeVar("_T", int, float, str)


def arg(args: dict[str, Any], name: str, kind: type[_T], default: _T) -> _T:
    """`args[name]` (or `default`) as `kind`; a ValueError naming the arg when it is not one."""
    value = args.get(name, default)
    try:
        if isinstance(value, bool | dict | list):
            raise TypeError
        return kind(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} {value!r} is not {'an' if kind is int else 'a'} {kind.__name__}") from None


def shape_args(name: str) -> frozenset[str] | None:
    """The args recipe `name` declares as shaping its state; None when it declares nothing (all do)."""
    declared = getattr(resolve(name), "shape_args", None)
    return frozenset(declared) if declared is not None else None


BUILTIN = {
    "digits": "spotrun.trainer.recipes.digits:build",
    "charlm": "spotrun.trainer.recipes.charlm:build",
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
    """Resolve and call a recipe. A ConfigError or ValueError it raises is the job file's to fix: a
    ConfigError naming the recipe and the error (the trainer exits CONFIG_ERROR, not retried). Any
    other error is the recipe's own bug, or a download that may pass on retry: raised as it is."""
    fn = resolve(name)
    check_args(name, args)
    try:
        inspect.signature(fn).bind(args, ctx)
    except TypeError as e:
        raise ConfigError(f"recipe {name!r} must take (args, ctx): {e}") from None
    try:
        parts = fn(args, ctx)
    except ConfigError:
        raise  # already one line that says what to fix
    except ValueError as e:  # the recipe's checks, torch's (nn.Dropout(p=2)): the args
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
