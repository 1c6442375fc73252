"""A recipe with `extra_state`: digits plus an EMA of the weights and a call counter, both updated
before every step. `EXTRA` picks which of them it returns (a test narrows it to change the job)."""

from __future__ import annotations

from typing import Any

import torch

from spotrun.trainer.recipes import Parts, RecipeContext, digits

EXTRA = {"ema", "calls"}


class EMA:
    """An exponential moving average of the model's weights."""

    def __init__(self, model: torch.nn.Module, decay: float = 0.9) -> None:
        self.model, self.decay = model, decay
        self.shadow = {k: v.detach().clone() for k, v in model.state_dict().items()}

    def update(self) -> None:
        for k, v in self.model.state_dict().items():
            self.shadow[k].mul_(self.decay).add_(v.detach(), alpha=1 - self.decay)

    def state_dict(self) -> dict[str, Any]:
        return {"decay": self.decay, "shadow": self.shadow}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.decay = float(sd["decay"])
        for k, v in sd["shadow"].items():
            self.shadow[k].copy_(v)


class Calls:
    def __init__(self) -> None:
        self.n = 0

    def state_dict(self) -> dict[str, Any]:
        return {"n": self.n}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.n = int(sd["n"])


def build(args: dict[str, Any], ctx: RecipeContext) -> Parts:
    parts = digits.build(args, ctx)
    ema, calls, loss_fn = EMA(parts.model), Calls(), parts.loss_fn

    def counted(model: torch.nn.Module, batch: Any) -> torch.Tensor:
        ema.update()
        calls.n += 1
        return loss_fn(model, batch)

    parts.loss_fn = counted
    parts.extra_state = {k: v for k, v in (("ema", ema), ("calls", calls)) if k in EXTRA}
    return parts
