"""One training attempt: build, resume from the newest valid checkpoint, train, checkpoint, stop.

Order matters for bitwise-exact resume: seed -> model -> optimizer -> scheduler -> load their
states -> data iterator for the epoch -> restore RNG -> first step. What is saved and loaded is the
registry of stateful parts (trainer/stateful.py); its `rng` part is deferred for that last step.
"""

from __future__ import annotations

import importlib
import json
import logging
import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

import numpy as np
import torch

from trainer import recipes
from trainer.checkpointer import Checkpointer
from trainer.ckpt_format import COMPLETED
from trainer.data import ResumableLoader
from trainer.distributed import Agreement, Ranks, wrap
from trainer.errors import ConfigError, LeaseLost, ResumeIncompatible, TrainingDiverged
from trainer.evaluation import evaluate_for_promotion
from trainer.exitcodes import ExitCode
from trainer.faults import Fault
from trainer.handover import ANNOUNCE_S, Handover
from trainer.handover import POLL_S as HANDOVER_POLL_S
from trainer.interval import Choice, IntervalTuner
from trainer.metrics_log import MetricsLog, prune_after
from trainer.preemption import (
    DEFAULT_UPLOAD_BPS,
    DEFAULT_WRITE_BPS,
    SavePlan,
    StopRequest,
    plan_emergency_save,
)
from trainer.recipes import Parts, RecipeContext
from trainer.resume import (
    Restored,
    ResumeSource,
    completed_for,
    durable_here,
    load_state,
    mark_completed,
    select_together,
)
from trainer.spec import Change, JobSpec, describe_changes, spec_changes
from trainer.state import RngState, state_nbytes, update_only_views
from trainer.stateful import Registry, Stateful
from trainer.status import StatusReporter
from trainer.storage import Storage
from trainer.validate import Expectation
from trainer.warm_start import warm_start

if TYPE_CHECKING:
    from trainer import sharded

log = logging.getLogger(__name__)

__all__ = ["AttemptOptions", "AttemptResult", "ResumeSource", "run_attempt"]


@dataclass
class AttemptOptions:
    cache: Path  # local disk for checkpoint copies
    max_steps: int | None = None  # stop (with a checkpoint) after this many steps in this attempt
    metrics_path: Path | None = None  # per-step losses as JSON lines (float.hex, for exact comparisons)
    ranks: Ranks = field(default_factory=Ranks.solo)  # this process's place among the job's ranks
    stop: StopRequest = field(default_factory=StopRequest)
    resume_from: ResumeSource | None = None  # a specific checkpoint instead of the newest valid one
    fault: Fault | None = None  # injected failure (rehearsals, tests)
    mtbf_s: float | None = None  # `every: auto`: seconds between reclaims (the controller's estimate)
    # Take the job's storage for writing (its lease), once the recipe is built: a prewarmed trainer
    # does the slow part (imports, recipe, data) while the worker it replaces still saves.
    claim: Callable[[], Storage] | None = None
    prewarmed: bool = False  # started at another worker's notice: warm the first step's imports while waiting
    # Train through a notice for up to this long, until the replacement stands by (trainer/handover.py);
    # 0: stop at the next step. `worker_id`: this trainer's name in the lease, which a standby names.
    handover_s: float = 0.0
    worker_id: str | None = None
    sigterm_window_s: float = 0.0  # a SIGTERM's warning before SIGKILL, when the provider knows it
    announce_s: float = ANNOUNCE_S  # how long a noticed trainer waits for its replacement's announcement
    reporter: StatusReporter = field(default_factory=StatusReporter)  # no stream: silent


@dataclass
class AttemptResult:
    code: ExitCode
    step: int
    resumed_from: int | None
    durable_step: int | None
    message: str = ""
    resharded_from: int | None = None  # the checkpoint's world size, when it differed from this run's
    changes: list[Change] = field(default_factory=list)  # trajectory changes allowed at this resume


def run_attempt(spec: JobSpec, storage: Storage, opts: AttemptOptions) -> AttemptResult:
    """Train until done, preempted, or `max_steps`; raise on errors (the entry point maps them to codes)."""
    ranks = opts.ranks
    done = completed_for(storage, spec)  # ConfigError: the storage holds another job, finished
    if done is not None:
        log.info("job %s already completed at step %d (%s/%s)", spec.name, done, storage.uri, COMPLETED)
        return AttemptResult(ExitCode.COMPLETED, done, done, done, "already completed")
    device = ranks.device(_device(spec))
    if spec.amp and ranks.strategy == "fsdp":
        raise ConfigError(
            "amp: true is not supported with distributed.strategy: fsdp yet; use ddp or amp: false"
        )
    _seed_everything(spec.seed)  # the same on every rank: FSDP2 shards each rank's copy of one init
    parts = recipes.build(
        spec.recipe, spec.args, RecipeContext(spec.seed, spec.total_steps, spec.batch_size, device)
    )
    if ranks.distributed:
        parts.model = wrap(parts.model, parts.optimizer, ranks)
        if ranks.rank:  # dropout masks differ per rank; rank 0 keeps the single-process stream
            _seed_everything(_rank_seed(spec.seed, ranks.rank))
    if opts.claim is not None:
        if opts.prewarmed:  # the first optimizer step imports torch._dynamo: 0.8 s, paid while waiting
            importlib.import_module("torch._dynamo")  # `import torch._dynamo` here would shadow torch
        storage = opts.claim()  # resume and publish only through the storage this trainer holds
    scaler = torch.amp.GradScaler(device.type) if spec.amp else None
    run = _Run(spec, parts, scaler, device, opts)
    run.storage = storage
    run.steps_log = MetricsLog(storage if ranks.is_zero else None)  # to storage once a checkpoint covers them

    def durable(step: int, sidecars_written: bool) -> None:  # the writer thread, after `latest` moved
        run.steps_log.written(step, sidecars_written)  # (or the loop, for a synchronous save)
        opts.reporter.emit("durable", step=step)

    expect = replace(
        Expectation.from_registry(run.state, spec.shape_hash(ranks.world_size)),
        shape_hash_at=spec.shape_hash, world_size=ranks.world_size,
        allow_reshard=spec.distributed is not None and spec.distributed.allow_reshard,
        spec=spec.model_dump(mode="json"), shape_args=run.shape_args, allow_changes=spec.resume.allow_changes,
    )  # fmt: skip
    selection = select_together(storage, opts.cache, expect, opts.resume_from, ranks)
    if ranks.is_zero:
        source = opts.resume_from.storage if opts.resume_from is not None else None
        log.info(selection.describe(source.uri if source is not None else storage.uri, into=storage.uri))
    resharded_from = run.reshard(selection.world_size) if selection.world_size is not None else None
    if spec.distributed is not None:
        from trainer.sharded import ShardedCheckpointer  # DCP: ~1 s of imports only ranks pay

        run.ckpt = ShardedCheckpointer(
            storage, opts.cache, spec.checkpoint.keep, run.state, ranks, spec.checkpoint.async_upload,
            pin_memory=device.type == "cuda", durable_step=durable_here(selection, opts.resume_from),
            on_durable=durable, strategy=ranks.strategy,
        )  # fmt: skip
    else:
        run.ckpt = Checkpointer(
            storage, opts.cache, spec.checkpoint.keep, spec.checkpoint.async_upload,
            pin_memory=device.type == "cuda", durable_step=durable_here(selection, opts.resume_from),
            on_durable=durable, update_only=lambda: update_only_views(parts.model, parts.optimizer),
        )  # fmt: skip
    pending = run.restore(selection.path, resharded_from) if selection.path is not None else None
    if selection.path is None:  # step 0: a warm start's source, never once the run has its own checkpoint
        started = warm_start(spec, parts, opts.cache)
        run.warm_start = started.to_json() if started is not None else None
    if run.changes and ranks.is_zero:
        log.warning(
            "resuming step %d with changed training settings (%s), as resume.allow_changes allows: from "
            "here on the run is not bitwise equal to an uninterrupted one; the change is recorded in "
            "every checkpoint from now on", run.step, describe_changes(run.changes),
        )  # fmt: skip
    if ranks.is_zero:
        _drop_lost_metrics(storage, run.step)
    torch.set_num_threads(run.threads)  # BLAS results differ bitwise across thread counts
    end = spec.total_steps if opts.max_steps is None else min(spec.total_steps, run.step + opts.max_steps)
    opts.reporter.emit(
        "started", resumed_from=selection.step, checkpoint=selection.uri,
        rejected=selection.rejected_records(), step=run.step, total_steps=spec.total_steps,
        resharded_from=resharded_from, changes=[c.as_dict() for c in run.changes] or None,
        warm_start=run.warm_start,
    )  # fmt: skip
    try:
        code = run.train(end, pending)
    finally:
        run.ckpt.close()
    if code is ExitCode.COMPLETED and ranks.is_zero:  # the promotion gate's evaluation: after the loop
        mark_completed(storage, spec, run.step, evaluate_for_promotion(spec, parts, opts.cache))
    return AttemptResult(
        code,
        run.step,
        selection.step,
        run.ckpt.durable_step,
        resharded_from=resharded_from,
        changes=run.changes,
    )


def _drop_lost_metrics(storage: Storage, step: int) -> None:
    """Metrics objects past the resume step are a lost future's (metrics_log.prune_after). Failing to
    delete them costs only their steps' first values in MLflow (equal for a deterministic run): warn."""
    try:
        prune_after(storage, step)
    except LeaseLost:
        raise
    except Exception as e:  # storage trouble: training does not depend on it
        log.warning("metrics objects past step %d not deleted (%s: %s)", step, type(e).__name__, e)


def _prior_cost_s(model: torch.nn.Module) -> float:
    """What a checkpoint should take from the loop before one was measured: the snapshot of weights and
    two AdamW moments into host memory at ~10 GB/s (0.07 s/GB measured), plus 10 ms of bookkeeping."""
    nbytes = 3 * sum(p.numel() * p.element_size() for p in model.parameters())
    return 0.01 + 0.1 * nbytes / 1e9


def _rank_seed(seed: int, rank: int) -> int:
    return (seed * 1_000_003 + rank * 7_919) % 2**63


class _Run:
    """The live training state of one attempt, and the loop over it."""

    def __init__(
        self,
        spec: JobSpec,
        parts: Parts,
        scaler: torch.amp.GradScaler | None,
        device: torch.device,
        opts: AttemptOptions,
    ) -> None:
        self.spec, self.parts, self.scaler, self.device, self.opts = spec, parts, scaler, device, opts
        self.ranks = opts.ranks
        # set once the resume point is chosen: it starts from that durable step
        self.ckpt: Checkpointer | sharded.ShardedCheckpointer
        self.batch_size = spec.batch_size  # per rank; changed only by a resharded resume
        self.loader = self._make_loader()
        self.threads = spec.threads or torch.get_num_threads()
        self.step, self.best, self.last_loss = 0, math.inf, math.nan
        self.since_ckpt = time.monotonic()
        self.plan: SavePlan | None = None  # the emergency-save decision, when a stop carried a deadline
        self.stop_reported = False
        self.stop_agreed = False  # distributed: the ranks agreed to stop after this step
        self.handover: Handover | None = None  # a noticed trainer waiting for its replacement
        self.handover_logged = False
        self.handover_at_count = 0  # stop requests when the handover began
        self.storage: Storage | None = None  # where the standby record is read (set by run_attempt)
        self.last_step_s = 0.0
        self.tuner: IntervalTuner | None = None  # `every: auto`: the interval from measured costs
        self.steps_log = MetricsLog(None)  # run_attempt gives rank 0 one that writes
        self.shape_args = recipes.shape_args(spec.recipe)
        self.changes: list[Change] = []  # trajectory changes this attempt resumed across
        self.change_log: list[dict[str, Any]] = []  # every allowed change so far, in trainer.pt
        self.warm_start: dict[str, Any] | None = None  # where init_from's weights came from, in trainer.pt
        held: dict[str, Stateful] = {"model": parts.model, "optimizer": parts.optimizer}
        held |= {"scheduler": parts.scheduler if parts.scheduler is not None else _NoScheduler()}
        held |= {"scaler": scaler} if scaler is not None else {}
        held |= {"rng": RngState(device), "trainer": self}
        self.state = Registry(self.ranks.rank, held, parts.extra_state, sharded=spec.distributed is not None)

    def _make_loader(self) -> ResumableLoader:
        spec, r = self.spec, self.ranks
        return ResumableLoader(
            self.parts.dataset, self.batch_size, spec.seed, spec.num_workers, r.rank, r.world_size
        )

    def reshard(self, saved_world: int) -> int | None:
        """Resume a checkpoint of `saved_world` ranks on this many (validation allowed it): keep the
        global batch, so the position (batches done in the epoch) still counts the same samples.
        Returns `saved_world` when it differs, else None."""
        world = self.ranks.world_size
        if saved_world == world:
            return None
        global_batch = self.spec.batch_size * saved_world
        if global_batch % world:
            raise ConfigError(
                f"cannot reshard {saved_world}->{world} ranks: the global batch {global_batch} "
                f"({self.spec.batch_size} x {saved_world}) does not divide by {world}; "
                "use a world size that divides it"
            )
        self.batch_size = global_batch // world
        self.loader = self._make_loader()
        if self.ranks.is_zero:
            log.warning(
                "resharded %d->%d ranks (not bitwise): global batch %d kept, %d per rank; "
                "RNG re-derived per rank",
                saved_world, world, global_batch, self.batch_size,
            )  # fmt: skip
        return saved_world

    def restore(self, path: Path, resharded_from: int | None = None) -> Restored:
        """Load every part but the RNG, which `_loop` applies once the epoch's iterator exists. A
        resharded resume re-derives each rank's RNG from (seed, rank, step) instead."""
        if self.state.sharded:
            from trainer.sharded import load_sharded

            load_sharded(path, self.state, self.ranks)
        restored = load_state(path, self.state, skip=("rng",) if resharded_from is not None else ())
        if resharded_from is not None:
            _seed_everything(_rank_seed(self.spec.seed + self.step, self.ranks.rank))
        return restored

    def state_dict(self) -> dict[str, Any]:
        """The registry's `trainer` part (trainer.pt; docs/checkpoint-format.md)."""
        spec = self.spec
        return {
            "step": self.step,
            "position": self.loader.position.state_dict(),
            "best_metric": self.best,
            "spec": spec.public_dump(),  # in the bucket: no credentials
            "spec_hash": spec.spec_hash(),
            "shape_hash": spec.shape_hash(),
            "torch_version": str(torch.__version__),  # str(): TorchVersion is not weights_only-safe
            "threads": self.threads,
            "rank": self.ranks.rank,
            "world_size": self.ranks.world_size,
            "device": self.device.type,
            "changes": self.change_log,
            **({"warm_start": self.warm_start} if self.warm_start is not None else {}),
        }

    def load_state_dict(self, meta: dict[str, Any]) -> None:
        self.step, self.best = int(meta["step"]), float(meta["best_metric"])
        self.loader.position.load_state_dict(meta["position"])
        changes = spec_changes(meta["spec"], self.spec.model_dump(mode="json"), self.shape_args)
        self.changes = [c for c in changes if c.kind == "trajectory"]  # shape: refused by validation
        self.change_log = list(meta.get("changes", []))
        self.warm_start = meta.get("warm_start")  # the first attempt's, for every later attempt's record
        self.change_log += [{"step": self.step, **c.as_dict()} for c in self.changes]
        saved = int(meta["threads"])
        self.threads = self.spec.threads or saved  # unpinned: adopt the checkpoint's, for exactness
        if saved != self.threads:
            log.warning(
                "thread count %d differs from the checkpoint's %d: results will drift", self.threads, saved
            )

    def train(self, end: int, pending: Restored | None) -> ExitCode:
        self.parts.model.train()
        if self.spec.checkpoint.every == "auto":
            mtbf = self.opts.mtbf_s or self.spec.checkpoint.mtbf_prior_s
            self.tuner = IntervalTuner(mtbf, _prior_cost_s(self.parts.model))
            self._report_interval(self.tuner.choice)
        metrics = open(self.opts.metrics_path, "a") if self.opts.metrics_path else None  # noqa: SIM115
        try:
            self._loop(end, pending, metrics, _Meter(self.step, quiet=not self.ranks.is_zero))
            # a stop that landed before the first step, or between two epochs, is reported here
            if self._stop_seen and not self.stop_reported:
                self._stopping()
            # Final, max-steps and emergency checkpoints are synchronous: exit only once durable. The
            # one in flight lands first, so every rank sees the same durable step here.
            self.ckpt.wait()
            if self.ckpt.durable_step != self.step and not self._skip_save:
                blocked = self.checkpoint(wait=True)
                log.info("checkpoint at step %d durable after %.2fs", self.step, blocked)
            self.ckpt.wait()
        finally:
            if metrics:
                metrics.close()
        return self._outcome()

    def _loop(self, end: int, pending: Restored | None, metrics: IO[str] | None, meter: _Meter) -> None:
        pos = self.loader.position
        while self.step < end and not self._stop_now():
            it = self.loader.epoch_iter()
            if pending is not None:  # after iter(): creating the iterator may draw from the global RNG
                pending.apply(self.state)
                pending = None
            for batch in it:
                lr = self.parts.optimizer.param_groups[0]["lr"]  # this step's; the scheduler moves it after
                # beside a save: also the step in which it ends, whose fence may have waited for its copy
                beside_save = self.ckpt.in_flight
                t0 = time.perf_counter()
                agreed = _step(
                    self.parts,
                    self.scaler,
                    batch,
                    self.device,
                    self.spec.amp,
                    self.step,
                    self._agree,
                    self.ckpt.fence,
                )
                self.last_step_s = time.perf_counter() - t0
                self._timed(self.last_step_s, beside_save)
                loss = agreed.loss
                self.step, pos.batch = self.step + 1, pos.batch + 1
                self.best, self.last_loss = min(self.best, loss), loss
                self.steps_log.record(self.step, loss, lr, self.parts.optimizer.param_groups[0]["lr"])
                if metrics:
                    metrics.write(json.dumps({"step": self.step, "loss": loss.hex()}) + "\n")
                    metrics.flush()
                logged = meter.tick(self.spec, self.step, loss, self.parts)
                self.opts.reporter.step(self.step, loss, meter.rate, self.ckpt.durable_step, force=logged)
                if self.opts.fault is not None:
                    self.opts.fault.maybe_fire(self.step, self.ranks.rank)
                self.ckpt.check()  # a background failure stops training here, not later
                if agreed.stop if self.ranks.distributed else self._stop_now():
                    self.stop_agreed = True
                    self._stopping()
                    return
                if self.step >= end:
                    return
                if self._checkpoint_due(agreed.due):
                    self.checkpoint()
            pos.epoch, pos.batch = pos.epoch + 1, 0

    def _agree(self, loss: float) -> Agreement:
        """After the forward pass, before backward: what every rank decides together (one all-reduce)."""
        tuned = self.tuner.choice.seconds if self.tuner is not None else None
        every_s = tuned or self.spec.checkpoint.every_seconds
        by_time = every_s is not None and time.monotonic() - self.since_ckpt >= every_s
        return self.ranks.agree(loss, self.opts.stop.requested, by_time)

    def _timed(self, step_s: float, beside_save: bool) -> None:
        """`every: auto`: one step's time (begun beside a save or not) for the tuner; report a new
        interval."""
        if self.tuner is not None and (moved := self.tuner.step(step_s, beside_save)):
            self._report_interval(moved)

    def _report_interval(self, choice: Choice) -> None:
        if self.ranks.is_zero:
            log.info("checkpoint interval: %s", choice.reason())
        self.opts.reporter.emit(
            "interval", seconds=round(choice.seconds, 3), cost_s=round(choice.cost_s, 4),
            mtbf_s=round(choice.mtbf_s, 1), measured=choice.measured, reason=choice.reason(),
        )  # fmt: skip

    @property
    def _stop_seen(self) -> bool:
        """One process: its own stop request. Ranks: only what they agreed on (one rank acting on its
        own flag would leave the others waiting in the next collective)."""
        return self.stop_agreed if self.ranks.distributed else self.opts.stop.requested

    def _stop_now(self) -> bool:
        """The loop's question, at a step boundary: stop here? As `_stop_seen`, except that a noticed
        single process trains on through a handover first (trainer/handover.py)."""
        if self.ranks.distributed:
            return self.stop_agreed
        return self.opts.stop.requested and self._handed_over()

    def _handed_over(self) -> bool:
        """Whether a noticed trainer may stop now: at once without `--handover-s` or on Ctrl-C; else
        once its replacement stands by, the handover's time is up, or a second stop request came."""
        stop, opts = self.opts.stop, self.opts
        if opts.handover_s <= 0 or opts.worker_id is None or stop.reason == "SIGINT":
            return True
        if self.handover is None:
            budget = self._handover_budget()
            if budget <= 0 or stop.count > 1:
                return True
            assert self.storage is not None
            self.handover = Handover(self.storage, opts.worker_id, budget, opts.announce_s)
            self.handover_at_count = stop.count
            if stop.deadline is None:  # a signal: the controller learns of the notice from this record
                opts.reporter.emit("notice", cloud="signal", action=stop.reason or "", stop=True)
            log.info(
                "notice (%s) at step %d: training on until the replacement stands by (at most %.1f s)",
                stop.reason, self.step, budget,
            )  # fmt: skip
        if stop.count > self.handover_at_count:  # a cancel, the machine shutting down: no more waiting
            self.handover.end("a second stop request")
        if not self.handover.ready:
            return False
        if not self.handover_logged:
            self.handover_logged = True
            h = self.handover
            log.info("handing over after %.2f s more training: %s", h.waited_s, h.reason)
        return True

    def _handover_budget(self) -> float:
        """Seconds of training a handover may add: `handover_s`, less what the emergency checkpoint
        needs before the notice's deadline (with its margin), or before the second half of a SIGTERM's
        window; a SIGTERM with no known window hands over nothing. The reserve assumes a periodic
        checkpoint in flight when the stop comes (two saves), plus a poll and two steps of lateness."""
        stop, opts = self.opts.stop, self.opts
        now = time.time()
        if stop.deadline is not None:
            end, margin = stop.deadline, self.spec.preemption.save_margin_s
        elif stop.reason == "SIGTERM" and opts.sigterm_window_s > 0:
            end, margin = (stop.received_at or now) + opts.sigterm_window_s, opts.sigterm_window_s / 2
        else:
            return 0.0
        nbytes, write_bps, upload_bps, _ = self._save_size_and_speed()
        save = plan_emergency_save(nbytes, write_bps, upload_bps, now, end, margin, in_flight=True).estimate_s
        late = HANDOVER_POLL_S + 2 * self.last_step_s
        return min(opts.handover_s, end - now - margin - save - late)

    @property
    def _stop_reason(self) -> str:
        """This process's own reason; a rank that stopped on another's word says so."""
        return self.opts.stop.reason or "a stop request of another rank"

    def _stopping(self) -> None:
        """At the step boundary after a stop request: decide on the emergency checkpoint, report it."""
        stop, self.stop_reported = self.opts.stop, True
        reason = self._stop_reason
        fields: dict[str, Any] = {"reason": reason, "step": self.step}
        if stop.deadline is not None:
            self.plan = self._plan_emergency_save(stop.deadline)
        if self.ranks.distributed:  # a save every rank can finish in time, or none (the slowest decides)
            mine = self.plan.save if self.plan is not None else True
            if not self.ranks.all_true(mine):
                why = (
                    self.plan.reason
                    if self.plan is not None and not mine
                    else "another rank cannot finish it in time"
                )
                self.plan = SavePlan(False, self.plan.estimate_s if self.plan else 0.0, why)
        if self.plan is not None:
            fields |= {"save": self.plan.save, "save_reason": self.plan.reason, "deadline": stop.deadline}
            log.warning(
                "stop on %s at step %d: %s emergency checkpoint (%s)",
                reason, self.step, "taking an" if self.plan.save else "skipping the", self.plan.reason,
            )  # fmt: skip
        self.opts.reporter.emit("stopping", **fields)

    def _save_size_and_speed(self) -> tuple[int, float, float, bool]:
        """What an emergency checkpoint would write and how fast: this rank's share (its last
        checkpoint's files, else the state it would capture), the write and upload bandwidth measured
        on the last checkpoints (else the defaults), and whether they were measured."""
        measured = self.ckpt.bandwidth()
        write_bps, upload_bps = measured or (DEFAULT_WRITE_BPS, DEFAULT_UPLOAD_BPS)
        nbytes = self.ckpt.history[-1].nbytes if self.ckpt.history else state_nbytes(self.capture())
        return nbytes, write_bps, upload_bps, measured is not None

    def _plan_emergency_save(self, deadline: float) -> SavePlan:
        if self.ckpt.durable_step == self.step:
            return SavePlan(True, 0.0, f"step {self.step} is already durable")
        nbytes, write_bps, upload_bps, measured = self._save_size_and_speed()
        return plan_emergency_save(
            nbytes, write_bps, upload_bps, time.time(), deadline,
            self.spec.preemption.save_margin_s, measured=measured, in_flight=self.ckpt.in_flight,
        )  # fmt: skip

    @property
    def _skip_save(self) -> bool:
        return self.plan is not None and not self.plan.save

    def _outcome(self) -> ExitCode:
        if self._skip_save:  # even at total_steps: completion needs the final checkpoint durable
            log.warning(
                "stopped on %s at step %d without an emergency checkpoint; newest durable step: %s",
                self._stop_reason, self.step, self.ckpt.durable_step,
            )  # fmt: skip
            return ExitCode.PREEMPTED
        if self.step >= self.spec.total_steps:
            return ExitCode.COMPLETED
        if self._stop_seen:
            log.warning("stopped on %s at step %d; checkpoint durable", self._stop_reason, self.step)
            return ExitCode.PREEMPTED
        log.info(
            "stopped at --max-steps (step %d of %d); checkpoint durable", self.step, self.spec.total_steps
        )
        return ExitCode.STOPPED

    def _checkpoint_due(self, by_time: bool) -> bool:
        """`by_time`: the clock said so at this step's agreement (any rank's clock, for ranks)."""
        pol = self.spec.checkpoint
        return (pol.every_steps is not None and self.step % pol.every_steps == 0) or by_time

    def checkpoint(self, wait: bool = False) -> float:
        """Snapshot the full state and persist it; returns the seconds the loop was blocked."""
        t0 = time.perf_counter()
        self.ckpt.wait()  # (save's own first step) the last save's steps leave the buffer before this
        sidecars = self.steps_log.sidecars(self.step)  # object is cut: each step in one object
        self.ckpt.save(self.capture(), self.manifest_base(), wait=wait, sidecars=sidecars)
        blocked = time.perf_counter() - t0
        self.since_ckpt = time.monotonic()
        if self.tuner is not None:
            self.tuner.saved(blocked)
        return blocked

    def capture(self) -> dict[str, Any]:
        """The full training state, part name -> state, as the checkpoint stores it."""
        return self.state.capture()

    def manifest_base(self) -> dict[str, Any]:
        metrics = {k: v for k, v in (("loss", self.last_loss), ("best_loss", self.best)) if math.isfinite(v)}
        return {
            "step": self.step,
            "spec_hash": self.spec.spec_hash(),
            "shape_hash": self.spec.shape_hash(),
            "world_size": self.ranks.world_size,
            "metrics": metrics,
        }


def _step(
    parts: Parts,
    scaler: torch.amp.GradScaler | None,
    batch: Any,
    device: torch.device,
    amp: bool,
    step: int,
    agree: Callable[[float], Agreement],
    fence: Callable[[], float] = lambda: 0.0,
) -> Agreement:
    """One training step. `fence` runs just before the update: a checkpoint saved at the end of the
    step before may still be copying the parameters and optimizer state, which nothing but the
    update changes (the forward and backward passes only read them), and the update waits for it."""
    dtype = torch.float16 if device.type == "cuda" else torch.bfloat16
    with torch.autocast(device.type, dtype=dtype, enabled=amp):
        loss = parts.loss_fn(parts.model, batch)
    agreed = agree(float(loss.detach()))  # before backward: a diverged rank stops all ranks here
    if not math.isfinite(agreed.loss):
        raise TrainingDiverged(
            f"loss is {agreed.loss} at step {step + 1}; lower the learning rate or check the data"
        )
    parts.optimizer.zero_grad(set_to_none=True)
    if scaler is not None:
        scaler.scale(loss).backward()
        scaler.unscale_(parts.optimizer)
    else:
        loss.backward()
    if parts.grad_clip:
        torch.nn.utils.clip_grad_norm_(parts.model.parameters(), parts.grad_clip)
    fence()
    if scaler is not None:
        scaler.step(parts.optimizer)
        scaler.update()
    else:
        parts.optimizer.step()
    if parts.scheduler is not None:
        parts.scheduler.step()
    return agreed


class _NoScheduler:
    """The `scheduler` part of a recipe without one: an empty state, so that every checkpoint holds the
    same parts whether or not the recipe schedules its learning rate."""

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state:
            raise ResumeIncompatible(
                "the checkpoint holds a scheduler's state and the recipe returns no scheduler; "
                "return the scheduler it was made with, or use a new storage URI"
            )


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def _device(spec: JobSpec) -> torch.device:
    if spec.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device: cuda requested but no CUDA device is visible; use device: auto or cpu")
    if spec.device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(spec.device)


class _Meter:
    """Steps per second over the last logging window; logs step, loss, lr and rate every log_every."""

    def __init__(self, step: int, quiet: bool = False) -> None:
        self.t, self.step, self.rate = time.perf_counter(), step, 0.0
        self.quiet = quiet  # ranks but the first: one progress line per step for the job

    def tick(self, spec: JobSpec, step: int, loss: float, parts: Parts) -> bool:
        if step % spec.log_every and step != spec.total_steps:
            return False
        now = time.perf_counter()
        self.rate = (step - self.step) / max(now - self.t, 1e-9)
        lr = parts.optimizer.param_groups[0]["lr"]
        if not self.quiet:
            log.info("step %d/%d loss %.4f lr %.3g %.1f steps/s", step, spec.total_steps, loss, lr, self.rate)
        self.t, self.step = now, step
        return True
