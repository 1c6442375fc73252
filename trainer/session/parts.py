"""The parts a session checkpoints besides the loop's own (its `trainer` part, an empty scheduler), its
progress meter, and the small rules it shares with the recipe loop."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from trainer.distributed import wrap
from trainer.errors import LeaseLost, ResumeIncompatible
from trainer.metrics_log import prune_after
from trainer.recipes import Parts
from trainer.session.options import AttemptOptions, rank_seed, seed_everything
from trainer.session.stopping import HandoverOptions
from trainer.spec import JobSpec, spec_changes
from trainer.storage import Storage

if TYPE_CHECKING:
    from trainer.session.core import Session

log = logging.getLogger("trainer.loop")  # the loop's log name, which log readers match


class TrainerPart:
    """The registry's `trainer` part (trainer.pt; docs/checkpoint-format.md)."""

    def __init__(self, s: Session) -> None:
        self.s = s

    def state_dict(self) -> dict[str, Any]:
        s, spec = self.s, self.s.spec
        return {
            "step": s.step,
            "position": s.position.state_dict(),
            "best_metric": s.best,
            "spec": spec.public_dump(),  # in the bucket: no credentials
            "spec_hash": spec.spec_hash(),
            "shape_hash": spec.shape_hash(),
            "torch_version": str(torch.__version__),  # str(): TorchVersion is not weights_only-safe
            "threads": s.threads,
            "rank": s.ranks.rank,
            "world_size": s.ranks.world_size,
            "device": s.device.type,
            "changes": s.change_log,
            **({"warm_start": s.warm_start} if s.warm_start is not None else {}),
        }

    def load_state_dict(self, meta: dict[str, Any]) -> None:
        s = self.s
        s.step, s.best = int(meta["step"]), float(meta["best_metric"])
        s.position.load_state_dict(meta["position"])
        changes = spec_changes(meta["spec"], s.spec.model_dump(mode="json"), s.shape_args)
        s.changes = [c for c in changes if c.kind == "trajectory"]  # shape: refused by validation
        s.change_log = list(meta.get("changes", []))
        s.warm_start = meta.get("warm_start")  # the first attempt's, for every later attempt's record
        s.change_log += [{"step": s.step, **c.as_dict()} for c in s.changes]
        saved = int(meta["threads"])
        s.threads = s.spec.threads or saved  # unpinned: adopt the checkpoint's, for exactness
        if saved != s.threads:
            log.warning(
                "thread count %d differs from the checkpoint's %d: results will drift", s.threads, saved
            )


class NoScheduler:
    """The `scheduler` part of a loop without one: an empty state, so that every checkpoint holds the
    same parts whether or not the loop schedules its learning rate."""

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state:
            raise ResumeIncompatible(
                "the checkpoint holds a scheduler's state and the loop has no scheduler; "
                "give the scheduler it was made with, or use a new storage URI"
            )


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


def handover_options(spec: JobSpec, opts: AttemptOptions) -> HandoverOptions:
    return HandoverOptions(
        handover_s=opts.handover_s,
        worker_id=opts.worker_id,
        sigterm_window_s=opts.sigterm_window_s,
        announce_s=opts.announce_s,
        save_margin_s=spec.preemption.save_margin_s,
    )


def parts_view(s: Session, evaluate: Callable[[torch.nn.Module], dict[str, float]] | None = None) -> Parts:
    """The session's parts as the warm start and the evaluation read them (no data, no loss)."""
    return Parts(s.model, s.optimizer, s.scheduler, None, None, extra_state=s.extra, evaluate=evaluate)  # type: ignore[arg-type]


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
