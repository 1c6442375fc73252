"""Small loops of one's own for the session's tests (entrypoint: tests.fakes.session_loops:NAME)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

import spotrun

DATA = [(torch.randn(8, 4, generator=torch.Generator().manual_seed(i)), torch.zeros(8)) for i in range(64)]


def _model() -> tuple[nn.Module, torch.optim.Optimizer]:
    model = nn.Linear(4, 1)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def _step(model: nn.Module, opt: torch.optim.Optimizer, batch: Any) -> float:
    x, y = batch
    opt.zero_grad()
    loss = ((model(x).squeeze(-1) - y) ** 2).mean()
    loss.backward()
    opt.step()
    return float(loss.detach())


def early_stop(args: dict[str, Any]) -> None:
    """Finishes at args['stop_at'] steps, however many the job has."""
    model, opt = _model()
    with spotrun.session(model=model, optimizer=opt) as s:
        for batch in s.batches(DATA):
            s.step_done(_step(model, opt, batch))
            if s.step == args["stop_at"]:
                s.finish("good enough")


def diverges() -> None:
    """A loss that is NaN at the third step."""
    model, opt = _model()
    with spotrun.session(model=model, optimizer=opt) as s:
        for batch in s.batches(DATA):
            loss = _step(model, opt, batch)
            s.step_done(float("nan") if s.step == 2 else loss)


def no_session() -> None:
    """Forgets to open the session."""


def wrong_batch_size() -> None:
    model, opt = _model()
    with spotrun.session(model=model, optimizer=opt) as s:
        for _ in s.batches(DATA, batch_size=3):
            pass


def reserved_extra() -> None:
    model, opt = _model()
    with spotrun.session(model=model, optimizer=opt, extra={"rng": opt}):
        pass


SEEN: list[list[list[int]]] = []  # accumulate's steps: each one's micro-batches, as sample ids


def accumulate(args: dict[str, Any]) -> None:
    """Accumulates over args['micro_batches'] batches of sample ids (0 .. args['samples'] - 1), recording
    each step's in SEEN."""
    model = nn.Linear(1, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    k = args["micro_batches"]
    ids = [torch.tensor(float(i)) for i in range(args["samples"])]
    with spotrun.session(model=model, optimizer=opt) as s:
        for step in s.batches(ids, micro_batches=k):
            micro = step if k > 1 else [step]
            opt.zero_grad()
            for x in micro:
                (model(x.unsqueeze(-1)).mean() / len(micro)).backward()
            opt.step()
            SEEN.append([[int(i) for i in x] for x in micro])
            s.step_done(0.0)


def micro_batches(args: dict[str, Any]) -> None:
    """Asks for args['k'] micro-batches (a refusal)."""
    model, opt = _model()
    with spotrun.session(model=model, optimizer=opt) as s:
        s.batches(DATA, micro_batches=args["k"])


def evaluates(args: dict[str, Any]) -> None:
    """An evaluation after every fifth step, inside `s.section("eval")`."""
    model, opt = _model()
    with spotrun.session(model=model, optimizer=opt) as s:
        for batch in s.batches(DATA):
            s.step_done(_step(model, opt, batch))
            if s.step % 5 == 0:
                with s.section("eval"), torch.no_grad():
                    model(batch[0] if isinstance(batch, list | tuple) else batch)
