"""`spotrun.session(...)`: a user's own training loop as a spotrun job.

The job file names the loop with `entrypoint: mypkg.train:main`; the trainer process seeds the global
RNGs with the job's seed, sets the job's context (spec, storage, options) and calls `main(args)` (or
`main()`). Inside it, `spotrun.session(model=..., optimizer=...)` opens the session: the model is wrapped
for the job's ranks, everything is restored from the newest valid checkpoint, and the block's end takes
the final checkpoint. Leaving the block after a stop (a notice, `max_steps`) raises SystemExit with the
attempt's exit code: `finally` blocks run, code after the loop does not; after the job's last step it
returns normally.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import torch

from spotrun.trainer.checkpoint.stateful import Stateful
from spotrun.trainer.errors import ConfigError
from spotrun.trainer.exitcodes import ExitCode
from spotrun.trainer.recipes.job_shape import spec_shape_args
from spotrun.trainer.session.core import Session
from spotrun.trainer.session.options import AttemptOptions, AttemptResult, seed_everything
from spotrun.trainer.session.parts import wrapped
from spotrun.trainer.spec.entrypoints import call_main, resolve_entrypoint, takes_args
from spotrun.trainer.spec.job import JobSpec
from spotrun.trainer.storage import Storage

log = logging.getLogger(__name__)
Evaluate = Callable[[torch.nn.Module], dict[str, float]]


class SessionEnded(SystemExit):
    """Leaving a session's block after a stop: the process exits with the attempt's code."""


@dataclass
class JobContext:
    """What the trainer process hands the user's loop (set only while the entry point runs)."""

    spec: JobSpec
    storage: Storage
    opts: AttemptOptions
    device: torch.device
    result: AttemptResult | None = None
    opened: bool = False


_current: JobContext | None = None


class UserSession:
    """The session as a user's loop holds it (`with spotrun.session(...) as s`)."""

    def __init__(self, core: Session, ctx: JobContext, evaluate: Evaluate | None) -> None:
        self._s, self._ctx, self._evaluate = core, ctx, evaluate

    @property
    def step(self) -> int:
        """Optimizer steps done (restored on resume)."""
        return self._s.step

    @property
    def resumed_from(self) -> int | None:
        """The checkpoint step this attempt resumed from (None: from scratch)."""
        return self._s.resumed_from

    @property
    def should_stop(self) -> bool:
        """Leave the loop: the job's last step, `max_steps`, or a stop request (its checkpoint planned)."""
        return self._s.should_stop

    @property
    def model(self) -> torch.nn.Module:
        """The model as the job's ranks train it (a DDP wrapper under ddp: call this one)."""
        return self._s.model

    @property
    def rank(self) -> int:
        return self._s.ranks.rank

    @property
    def world_size(self) -> int:
        return self._s.ranks.world_size

    @property
    def device(self) -> torch.device:
        return self._s.device

    @property
    def args(self) -> dict[str, Any]:
        """The job file's `args`."""
        return dict(self._ctx.spec.args)

    def batches(
        self, dataset: Any, batch_size: int | None = None, *, micro_batches: int = 1
    ) -> Iterator[Any]:
        """The trainer's seed-pure stream of batches over a map-style dataset, from the restored position.
        `micro_batches=K` > 1: a list of K batches per optimizer step, the position advancing K batches a
        step; an epoch's last group of fewer than K batches is dropped (the next epoch begins)."""
        return self._s.batches(dataset, batch_size, micro_batches=micro_batches)

    def start(self) -> None:
        """With your own data loader: call after making its iterator (the checkpoint's RNG applies then)."""
        self._s.start()

    def step_done(self, loss: float | torch.Tensor | None = None, **metrics: float) -> None:
        """The step boundary, once per optimizer step: counts, records (the loss and `metrics`, sent to
        MLflow once), checkpoints when due, sets should_stop."""
        self._s.step_done(loss, **metrics)

    def finish(self, reason: str = "") -> None:
        """End the job here as completed (early stopping)."""
        self._s.finish(reason)

    def fence(self) -> None:
        """Wait until a background save has copied the parameters and optimizer state: call it before
        writing them outside `optimizer.step()` (every optimizer step does it by itself)."""
        self._s.ckpt.fence()

    @contextmanager
    def modifying(self) -> Iterator[None]:
        """`with s.modifying():` around writes to parameters outside `optimizer.step()` (an EMA swapped
        in for an evaluation pass): the block waits for a background save's copy first."""
        self.fence()
        yield

    @contextmanager
    def section(self, name: str = "eval") -> Iterator[None]:
        """`with s.section("eval"):` around a stretch that is no training step (an evaluation, a data
        reload): the controller's watchdog does not take it for a hung step (`watchdog.section_s` may
        bound it), and the step timer starts again after it."""
        with self._s.section(name):
            yield

    def log(self, **metrics: float) -> None:
        """Log metrics in the trainer's log, at this step."""
        shown = " ".join(f"{k}={v:.6g}" for k, v in metrics.items())
        log.info("step %d: %s", self._s.step, shown)

    def __enter__(self) -> UserSession:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if exc is not None:
            self._s.abandon()
            return
        self._ctx.result = result = self._s.close(self._evaluate)
        if result.code is not ExitCode.COMPLETED:
            raise SessionEnded(int(result.code))


def session(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any = None,
    extra: Mapping[str, Stateful] | None = None,
    *,
    evaluate: Evaluate | None = None,
) -> UserSession:
    """Open the job's session around your loop: restores model, optimizer, scheduler and every `extra`
    part (anything with state_dict()/load_state_dict()) from the newest valid checkpoint."""
    ctx = _current
    if ctx is None:
        raise ConfigError(
            "spotrun.session() runs inside a spotrun job: name this function in a job file "
            "(entrypoint: module:function) and run it with `spotrun run job.yaml` or "
            "`python -m spotrun.trainer --config job.yaml`"
        )
    if ctx.opened:
        raise ConfigError("spotrun.session() was already opened in this job; open it once per run")
    ctx.opened = True
    spec, opts = ctx.spec, ctx.opts
    model = wrapped(model, optimizer, spec, opts)
    core = Session(
        spec,
        ctx.storage,
        opts,
        model=model,
        optimizer=optimizer,
        scheduler=scheduler,
        extra=extra,
        device=ctx.device,
        shape_args=spec_shape_args(spec),
    )
    return UserSession(core.open(), ctx, evaluate)


def run_entrypoint(
    spec: JobSpec, storage: Storage, opts: AttemptOptions, device: torch.device
) -> AttemptResult:
    """Import the job's entry point, seed the global RNGs, call it with the job's context set; the result
    of its session."""
    global _current
    assert spec.entrypoint is not None
    fn = resolve_entrypoint(spec.entrypoint)
    takes_args(fn, spec.entrypoint)  # a signature it cannot be called with: one line, before the lease
    seed_everything(spec.seed)  # after the import: a module's top level may draw from the global RNG
    ctx = JobContext(spec, storage, opts, device)
    _current = ctx
    try:
        call_main(fn, dict(spec.args), spec.entrypoint)
    except SessionEnded:
        pass
    finally:
        _current = None
    if ctx.result is None:
        raise ConfigError(
            f"entrypoint {spec.entrypoint} returned without finishing spotrun.session(); open it around "
            "your training loop (with spotrun.session(...) as s: ...)"
        )
    return ctx.result
