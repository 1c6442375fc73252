"""get_state_dict's answer, kept between sharded saves: the same values a fresh call gives, rebuilt
when the optimizer gains state or a tensor it holds no longer views the live one. (No process group
is needed: get_state_dict takes a plain module too; FSDP2 and DDP go through the same code in
tests/e2e/test_distributed.py, which resumes them bitwise.)"""

from __future__ import annotations

from typing import Any, cast

import torch

from trainer.sharded import DcpStateCache, dcp_state
from trainer.stateful import Registry


def setup() -> tuple[Any, torch.nn.Module, torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    return cast(Registry, {"model": model, "optimizer": opt}), model, opt, sched


def train(model: torch.nn.Module, opt: torch.optim.Optimizer, sched: Any) -> None:
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    opt.zero_grad()
    sched.step()


def same(a: Any, b: Any) -> bool:
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    return bool(a == b)


def test_reused_while_it_views_the_live_state() -> None:
    registry, model, opt, sched = setup()
    cache = DcpStateCache()
    second = cache.get(registry)  # get_state_dict makes a fresh optimizer's state (a zero-lr step)
    assert second["optimizer"]["state"]
    for _ in range(3):
        train(model, opt, sched)
        again = cache.get(registry)
        assert again is second  # reused ...
        assert same(again, dcp_state(registry))  # ... with the values, step and lr a fresh call gives
    assert second["optimizer"]["param_groups"][0]["lr"] == 0.1 * 0.5**3


def test_rebuilt_when_the_optimizer_state_is_replaced() -> None:
    registry, model, opt, sched = setup()
    cache = DcpStateCache()
    kept = cache.get(registry)
    opt.state.clear()  # as a load does: the next step makes new state tensors
    train(model, opt, sched)
    fresh = cache.get(registry)
    assert fresh is not kept and same(fresh, dcp_state(registry))


def test_rebuilt_when_a_tensor_no_longer_views_the_live_one() -> None:
    registry, model, opt, sched = setup()
    cache = DcpStateCache()
    train(model, opt, sched)
    kept = cache.get(registry)
    weight = next(model.parameters())
    weight.data = weight.data.clone() + 1  # a load, or a reallocated parameter
    fresh = cache.get(registry)
    assert fresh is not kept and same(fresh, dcp_state(registry))
