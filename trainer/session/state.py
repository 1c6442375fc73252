"""A session's state: what one attempt holds around a training loop, and the parts it checkpoints beside
the loop's own (its `trainer` part, an empty scheduler). The opening (trainer/session/opening.py) and the
step boundary (trainer/session/core.py) work on it."""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Mapping
from typing import IO, TYPE_CHECKING, Any

import torch

from spotrun.trainer.checkpoint.state import RngState
from spotrun.trainer.checkpoint.stateful import Registry, Stateful
from spotrun.trainer.errors import ConfigError, ResumeIncompatible
from spotrun.trainer.preemption.requests import SavePlan
from spotrun.trainer.preemption.stopping import HandoverGate, HandoverOptions
from spotrun.trainer.recipes import Parts
from spotrun.trainer.recipes.data import Position
from spotrun.trainer.saving.checkpointer import Checkpointer
from spotrun.trainer.saving.interval import Choice, IntervalTuner
from spotrun.trainer.session.options import AttemptOptions
from spotrun.trainer.session.parts import Meter
from spotrun.trainer.session.resume import Restored
from spotrun.trainer.spec.job import Change, JobSpec, spec_changes
from spotrun.trainer.storage import Storage
from spotrun.trainer.telemetry.metrics_log import MetricsLog

if TYPE_CHECKING:
    from spotrun.trainer.saving import sharded
    from spotrun.trainer.saving.peer import PeerSender

log = logging.getLogger("spotrun.trainer.session.loop")  # the loop's log name, which log readers match
RESERVED = ("model", "optimizer", "scheduler", "scaler", "rng", "trainer")


class SessionState:
    """One attempt's training state: the loop's parts, where it stands, and what it decided so far."""

    def __init__(
        self,
        spec: JobSpec,
        storage: Storage,
        opts: AttemptOptions,
        *,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: Any = None,
        extra: Mapping[str, Stateful] | None = None,
        device: torch.device,
        scaler: torch.amp.GradScaler | None = None,
        shape_args: frozenset[str] | None = None,
    ) -> None:
        self.spec, self.storage, self.opts, self.device = spec, storage, opts, device
        self.ranks = opts.ranks
        self.model, self.optimizer, self.scheduler, self.scaler = model, optimizer, scheduler, scaler
        clash = sorted(set(extra or {}) & set(RESERVED))
        if clash:
            raise ConfigError(f"extra part {clash[0]!r} is a name spotrun uses itself; rename it")
        self.extra = dict(extra or {})
        self.shape_args = shape_args
        self.batch_size = spec.batch_size  # per rank; changed only by a resharded resume
        self.position = Position()
        self.threads = spec.threads or torch.get_num_threads()
        self.step, self.best, self.last_loss = 0, math.inf, math.nan
        self.should_stop = False
        self.resumed_from: int | None = None
        self.changes: list[Change] = []  # trajectory changes this attempt resumed across
        self.skip_steps = 0  # steps' data to skip before the first batch (a rollback), until `batches()`
        self.change_log: list[dict[str, Any]] = []  # every allowed change so far, in trainer.pt
        self.warm_start: dict[str, Any] | None = None  # where init_from's weights came from, in trainer.pt
        self.resharded_from: int | None = None
        self.end = spec.total_steps
        self.ckpt: Checkpointer | sharded.ShardedCheckpointer
        self.steps_log = MetricsLog(None)
        self.tuner: IntervalTuner | None = None  # `every: auto`: the interval from measured costs
        self.peer: PeerSender | None = None  # copies to the warm standby (checkpoint.standby_every_s)
        self.plan: SavePlan | None = None  # the emergency-save decision, when a stop carried a deadline
        self.stop_reported = self.stop_agreed = self.finished_early = False
        self.gate = HandoverGate(opts.stop, handover_options(spec, opts), opts.reporter)
        self.since_ckpt = time.monotonic()
        self.last_step_s = 0.0
        self._t_step = time.perf_counter()
        self._beside_save = False
        self._pending: Restored | None = None  # the RNG, applied once the data iterator exists
        self._lr_at_step: float | None = None  # the learning rate the update used (the step pre-hook)
        self._lr_before: float | None = None  # ... or as the step began, where it took no update
        self._hooks: list[Any] = []
        self._metrics: IO[str] | None = None
        self._meter: Meter | None = None
        self._selection_step: int | None = None
        held: dict[str, Stateful] = {"model": model, "optimizer": optimizer}
        held |= {"scheduler": scheduler if scheduler is not None else NoScheduler()}
        held |= {"scaler": scaler} if scaler is not None else {}
        held |= {"rng": RngState(device), "trainer": TrainerPart(self)}
        self.state = Registry(self.ranks.rank, held, self.extra, sharded=spec.distributed is not None)

    def _before_update(self, optimizer: torch.optim.Optimizer, *_: Any) -> None:
        """The optimizer's step pre-hook: the step's learning rate, and the copy fence."""
        if optimizer is self.optimizer:
            self._lr_at_step = float(optimizer.param_groups[0]["lr"])
        self.ckpt.fence()

    def _report_interval(self, choice: Choice) -> None:
        if self.ranks.is_zero:
            log.info("checkpoint interval: %s", choice.reason())
        self.opts.reporter.emit(
            "interval",
            seconds=round(choice.seconds, 3),
            cost_s=round(choice.cost_s, 4),
            mtbf_s=round(choice.mtbf_s, 1),
            measured=choice.measured,
            reason=choice.reason(),
        )

    def parts_view(self, evaluate: Callable[[torch.nn.Module], dict[str, float]] | None = None) -> Parts:
        """The session's parts as the warm start and the evaluation read them (no data, no loss)."""
        none: Any = None  # no dataset and no loss function: neither reads them
        return Parts(
            self.model,
            self.optimizer,
            self.scheduler,
            dataset=none,
            loss_fn=none,
            extra_state=self.extra,
            evaluate=evaluate,
        )


class TrainerPart:
    """The registry's `trainer` part (trainer.pt; docs/checkpoint-format.md)."""

    def __init__(self, s: SessionState) -> None:
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


def handover_options(spec: JobSpec, opts: AttemptOptions) -> HandoverOptions:
    return HandoverOptions(
        handover_s=opts.handover_s,
        worker_id=opts.worker_id,
        sigterm_window_s=opts.sigterm_window_s,
        announce_s=opts.announce_s,
        save_margin_s=spec.preemption.save_margin_s,
    )
