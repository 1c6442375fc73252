"""The parts a session checkpoints besides the loop's own (its `trainer` part, an empty scheduler), its
progress meter, and the small rules it shares with the recipe loop."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import torch

from spotrun.trainer.distributed.ranks import wrap
from spotrun.trainer.errors import LeaseLost
from spotrun.trainer.session.options import AttemptOptions, rank_seed, seed_everything
from spotrun.trainer.spec.job import JobSpec
from spotrun.trainer.storage import Storage
from spotrun.trainer.telemetry.metrics_log import prune_after

if TYPE_CHECKING:
    pass

log = logging.getLogger("spotrun.trainer.session.loop")  # the loop's log name, which log readers match


class Meter:
    """Steps per second over the last logging window; logs step, loss, lr and rate every log_every."""

    def __init__(self, step: int, quiet: bool = False) -> None:
        self.t, self.step, self.rate = time.perf_counter(), step, 0.0
        self.quiet = quiet  # ranks but the first: one progress line per step for the job

    def tick(self, spec: JobSpec, step: int, loss: float, lr: float) -> bool:
        if step % spec.log_every and step != spec.total_steps:
            return False
        now = time.perf_counter()
        self.rate = (step - self.step) / max(now - self.t, 1e-9)
        if not self.quiet:
            log.info("step %d/%d loss %.4f lr %.3g %.1f steps/s", step, spec.total_steps, loss, lr, self.rate)
        self.t, self.step = now, step
        return True


def wrapped(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, spec: JobSpec, opts: AttemptOptions
) -> torch.nn.Module:
    """The model as the job's ranks train it (DDP or FSDP2), reseeding ranks past the first."""
    ranks = opts.ranks
    if not ranks.distributed:
        return model
    model = wrap(model, optimizer, ranks)
    if ranks.rank:  # dropout masks differ per rank; rank 0 keeps the single-process stream
        seed_everything(rank_seed(spec.seed, ranks.rank))
    return model


def drop_lost_metrics(storage: Storage, step: int) -> None:
    """Metrics objects past the resume step are a lost future's (metrics_log.prune_after). Failing to
    delete them costs only their steps' first values in MLflow (equal for a deterministic run): warn."""
    try:
        prune_after(storage, step)
    except LeaseLost:
        raise
    except Exception as e:  # storage trouble: training does not depend on it
        log.warning("metrics objects past step %d not deleted (%s: %s)", step, type(e).__name__, e)


def prior_cost_s(model: torch.nn.Module) -> float:
    """What a checkpoint should take from the loop before one was measured: the snapshot of weights and
    two AdamW moments into host memory at ~10 GB/s (0.07 s/GB measured), plus 10 ms of bookkeeping."""
    nbytes = 3 * sum(p.numel() * p.element_size() for p in model.parameters())
    return 0.01 + 0.1 * nbytes / 1e9
