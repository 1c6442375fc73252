"""get_state_dict's answer, kept between sharded saves: the same values a fresh call gives, rebuilt
when the optimizer gains state or a tensor it holds no longer views the live one. (No process group
is needed: get_state_dict takes a plain module too; FSDP2 and DDP go through the same code in
tests/e2e/test_distributed.py, which resumes them bitwise.)"""

from __future__ import annotations

from typing import Any, cast

import torch

from spotrun.trainer.checkpoint.stateful import Registry
from spotrun.trainer.saving.sharded import DcpStateCache, dcp_state


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


def test_what_only_the_update_changes_is_copied_during_the_next_step() -> None:
    """A background save copies the parameters and optimizer state while the next step's forward and
    backward run (they only read them), and the update waits for that copy. A buffer that forward
    changes (BatchNorm's running stats) is copied at the step boundary, with the rest of the state."""
    from spotrun.trainer.saving.sharded import ShardStager

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    registry = cast(Registry, {"model": model, "optimizer": opt})
    cache, stager = DcpStateCache(), ShardStager()
    for _ in range(2):
        train(model, opt, sched)
        state = cache.get(registry)
        at_save = {k: v.clone() for k, v in _flat(state).items()}
        staged = stager.stage(state, cache.update_only)
        deferred = {k for k, v in _flat(state).items() if id(v) in cache.update_only}
        assert deferred and all(".weight" in k or ".bias" in k or "state" in k for k in deferred)
        assert not any("running" in k or "num_batches" in k for k in deferred)
        model(torch.randn(3, 4)).sum().backward()  # the next step's forward moves the running stats
        stager.later.run()  # the writer's copy, before the update below (the loop's fence)
        opt.step()
        opt.zero_grad()
        sched.step()
        assert _flat(staged).keys() == at_save.keys()
        assert all(torch.equal(v, at_save[k]) for k, v in _flat(staged).items())


def _flat(state: Any) -> dict[str, torch.Tensor]:
    from spotrun.trainer.checkpoint.state import iter_tensors

    return dict(iter_tensors(state))


def test_the_fence_holds_the_update_until_the_copy_is_done() -> None:
    """`fence()` blocks while the save in flight still copies; a save that fails before its copy
    releases it too (its error then surfaces at the next check)."""
    import threading
    import time

    import pytest

    from spotrun.trainer.errors import CheckpointError
    from spotrun.trainer.saving.checkpointer import BackgroundSaver

    saver = BackgroundSaver(None, None)
    assert saver.fence() == 0.0  # nothing in flight
    go = threading.Event()

    def persist() -> None:
        time.sleep(0.2)  # the write goes on after the copy: the update does not wait for it

    def copy() -> None:
        go.wait()

    saver._persist_in(True, persist, copy=copy)
    t = threading.Timer(0.2, go.set)
    t.start()
    waited = saver.fence()
    assert waited >= 0.15 and saver.in_flight
    saver.wait()

    def fails() -> None:
        raise OSError("disk gone")

    saver._persist_in(True, persist, copy=fails)
    saver.fence()  # returns: does not hang on a copy that failed
    with pytest.raises(CheckpointError, match="disk gone"):
        saver.wait()


def test_a_copy_left_to_the_writer_is_torn_when_its_tensor_was_written_first() -> None:
    """The version counter a tensor shares with its views tells whether anything wrote it between
    the save and the writer's copy; an unchanged one is copied as it was."""
    import pytest

    from spotrun.trainer.checkpoint.state import LaterCopies, TornSnapshot, view_of

    live = torch.arange(6.0)
    later = LaterCopies()
    for written in (False, True):
        dst = torch.empty(6)
        later.start({view_of(live)})
        later.copy(dst, live.detach())  # as a snapshot takes it: a detached view
        assert later.pending
        if written:
            live.mul_(2)
            with pytest.raises(TornSnapshot, match="1 parameter or optimizer tensor"):
                later.run()
        else:
            later.run()
            assert torch.equal(dst, live)
        assert not later.pending


def test_what_is_left_to_the_writer_is_the_optimizers_own() -> None:
    """Deferred: the parameters the optimizer updates and its state. At the boundary: a parameter it
    does not hold (frozen, or an EMA copy a loss_fn updates), buffers, and tensors with no storage of
    their own to compare (sparse), which a snapshot still copies."""
    from spotrun.trainer.checkpoint.state import LaterCopies, update_only_views, view_of

    torch.manual_seed(0)
    trained, frozen = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
    model = torch.nn.Sequential(trained, torch.nn.BatchNorm1d(4), frozen)
    opt = torch.optim.AdamW(trained.parameters(), lr=0.1)
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    views = update_only_views(model, opt)
    state = [t for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    assert views == {view_of(t) for t in [*trained.parameters(), *state]}
    later, sparse = LaterCopies(), torch.eye(3).to_sparse()
    later.start(views)
    dst = torch.empty(3, 3).to_sparse()
    later.copy(dst, sparse)  # copied now, not deferred: no error for its missing strided storage
    assert not later.pending and torch.equal(dst.to_dense(), torch.eye(3))
