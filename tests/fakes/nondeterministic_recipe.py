"""A recipe that breaks determinism on purpose: digits, with each step's loss scaled by up to ±1% of noise
from the operating system's entropy (no seed, nothing checkpointed). Steps computed twice differ, so
the resume-fidelity check must say `mismatch`."""

from __future__ import annotations

import random
from typing import Any

import torch

from spotrun.trainer.recipes import Parts, RecipeContext, digits

_NOISE = random.SystemRandom()


def build(args: dict[str, Any], ctx: RecipeContext) -> Parts:
    parts = digits.build(args, ctx)
    loss_fn = parts.loss_fn

    def noisy(model: torch.nn.Module, batch: Any) -> torch.Tensor:
        return loss_fn(model, batch) * (1 + 0.02 * (_NOISE.random() - 0.5))

    parts.loss_fn = noisy
    return parts
