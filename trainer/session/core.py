"""The session: a training loop's step boundary, whoever writes the loop.

`Session.open()` restores everything from the newest valid checkpoint (RNG last, at the first batch);
`batches()` yields the trainer's seed-pure data stream from the restored position; `step_done()` is the
one step boundary in the code base: the ranks agree (stop, checkpoint due, the mean loss), a non-finite
loss is refused before any checkpoint, the step's metrics are recorded once, a due checkpoint is taken in
the background, and a stop request (a notice, a handover, `max_steps`, `total_steps`) sets
`should_stop` once the emergency checkpoint is planned. `close()` takes the final checkpoint and
returns the attempt's result. The recipe loop (trainer/session/loop.py) and a user's own loop
(`spotrun.session`) both run on it.

The copy fence is an optimizer step pre-hook on every optimizer the session holds: a background save
copies parameters and optimizer state while the next forward and backward run, and only the update
waits for the copy (nothing else writes them).
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch

from spotrun.trainer.checkpoint.completion import mark_completed
from spotrun.trainer.checkpoint.state import state_nbytes
from spotrun.trainer.errors import ConfigError, TrainingDiverged
from spotrun.trainer.exitcodes import ExitCode
from spotrun.trainer.preemption.stopping import SaveCost, agreed_plan, emergency_plan
from spotrun.trainer.recipes.data import ResumableLoader
from spotrun.trainer.session.evaluation import evaluate_for_promotion
from spotrun.trainer.session.opening import open_session
from spotrun.trainer.session.options import AttemptResult
from spotrun.trainer.session.state import SessionState

if TYPE_CHECKING:
    pass

log = logging.getLogger("spotrun.trainer.session.loop")  # the loop's log name, which log readers match
RESERVED = ("model", "optimizer", "scheduler", "scaler", "rng", "trainer")


class Session(SessionState):
    """One attempt's training state around a loop: resume, the step boundary, the final checkpoint."""

    def open(self) -> Session:
        """Claim the storage, choose and load the resume point (the RNG waits for the first batch), warm
        start at step 0, report where training starts from (trainer/session/opening.py)."""
        open_session(self)
        return self

    # ---- the data and the RNG ----

    def start(self) -> None:
        """Apply the checkpoint's RNG now: after the data iterator exists (creating one may draw from the
        global RNG). `batches()` calls it; a loop with its own loader calls it after making its iterator."""
        if self._pending is not None:
            self._pending.apply(self.state)
            self._pending = None

    def batches(
        self, dataset: Any, batch_size: int | None = None, *, micro_batches: int = 1
    ) -> Iterator[Any]:
        """The trainer's data stream over a map-style dataset: a seed-pure permutation per epoch, from
        the restored position, until the job's last step or a stop.

        `micro_batches=K` > 1 (gradient accumulation): one list of K batches per optimizer step, the
        position advancing K batches a step (the checkpoint's position counts batches, so a checkpoint
        of another K resumes at the first batch it did not use). An epoch's last group, when fewer than
        K batches are left, is dropped: the next epoch begins. Refusals come here, before the first
        batch (a generator would raise them only at the first `next`)."""
        if batch_size is not None and batch_size != self.spec.batch_size:
            why = f"batches(batch_size={batch_size}) differs from the job's batch_size {self.spec.batch_size}"
            raise ConfigError(f"{why}; set batch_size in the job file, not in code")
        k = micro_batches
        if isinstance(k, bool) or not isinstance(k, int):
            raise ConfigError(
                f"batches(micro_batches={k!r}) is not an int; pass a whole number of batches per step, "
                "such as micro_batches=4"
            )
        if k < 1:
            raise ConfigError(
                f"batches(micro_batches={k}) is below 1; pass 1 (no accumulation) or more batches per step"
            )
        r = self.ranks
        loader = ResumableLoader(
            dataset,
            self.batch_size,
            self.spec.seed,
            num_workers=self.spec.num_workers,
            rank=r.rank,
            world=r.world_size,
        )
        per_epoch = loader.batches_per_epoch()
        if k > per_epoch:
            raise ConfigError(
                f"batches(micro_batches={k}) is more than the {per_epoch} batches of {self.batch_size} in an "
                "epoch, so no step would be full; lower micro_batches or the job's batch_size"
            )
        if self.skip_steps:  # a rollback's skip: the batches that may have caused the spike
            self.position.skip(self.skip_steps, per_epoch, k)
            self.skip_steps = 0
        loader.position = self.position
        return self._stream(loader, k)

    def _stream(self, loader: ResumableLoader, k: int) -> Iterator[Any]:
        """`batches()`' stream: K batches a step (one batch, not a list, when K is 1)."""
        pos, per_epoch = self.position, loader.batches_per_epoch()
        while self.step < self.end and not self.should_stop and not self._stop_now():
            if per_epoch - pos.batch < k:  # the epoch's short group (none left, when K is 1): dropped
                pos.epoch, pos.batch = pos.epoch + 1, 0
            it = loader.epoch_iter()
            self.start()  # after iter()
            for _ in range((per_epoch - pos.batch) // k):
                group = [next(it) for _ in range(k)]
                pos.batch += k
                self._lr_before = float(self.optimizer.param_groups[0]["lr"])  # a step the scaler skips
                yield group if k > 1 else group[0]
                if self.should_stop or self.step >= self.end:
                    return
            del it  # its workers end before the next epoch's start
            pos.epoch, pos.batch = pos.epoch + 1, 0

    # ---- the step boundary ----

    def step_done(self, loss: float | torch.Tensor | None = None, **metrics: float) -> None:
        """One optimizer step is done: count it, record it (its loss, learning rate and `metrics`, sent to
        MLflow once), checkpoint when due, and set `should_stop` when the job's end or a stop request
        (with its emergency checkpoint planned) is reached."""
        if self._pending is not None:
            log.warning("step_done before the first batch: call s.start() after making your data iterator")
            self.start()
        if self.skip_steps:  # nothing to skip with: this loop draws its data itself
            log.warning("the rollback's data skip was not applied: this loop does not use s.batches()")
            self.skip_steps = 0
        value = (
            float(loss.detach())
            if isinstance(loss, torch.Tensor)
            else (math.nan if loss is None else float(loss))
        )
        agreed = self.ranks.agree(
            0.0 if loss is None else value, self.opts.stop.requested, self._time_due(), self.ckpt.failed
        )
        if loss is not None and not math.isfinite(agreed.loss):
            raise TrainingDiverged(
                f"loss is {agreed.loss} at step {self.step + 1}; lower the learning rate or check the data"
            )
        now = time.perf_counter()
        self.last_step_s, self._t_step = now - self._t_step, now
        self._timed(self.last_step_s, self._beside_save)
        if self.peer is not None:
            self.peer.step(self.last_step_s, self._beside_save)
        self.step += 1
        self._record(agreed.loss if loss is not None else math.nan, metrics)
        if self.opts.fault is not None:
            self.opts.fault.maybe_fire(self.step, self.ranks.rank, self.model)
        if agreed.failed:  # a background failure, as the ranks agreed on it: all stop at this step
            self.ckpt.wait()  # raises it (another rank's saver may have it first: this one waits for it)
        if agreed.stop if self.ranks.distributed else self._stop_now():
            self.stop_agreed = True
            self._stopping()
            self.should_stop = True
        elif self.step >= self.end:
            self.should_stop = True
        elif self._checkpoint_due(agreed.due):
            self.checkpoint()
        elif self.peer is not None and self.peer.due():  # a copy to the warm standby, in memory there
            self.peer.send(self.state.capture(), self._manifest_base(), self.steps_log.sidecars(self.step))
        self._beside_save = self.ckpt.in_flight
        self._t_step = time.perf_counter()

    def _record(self, loss: float, metrics: dict[str, float]) -> None:
        lr_after = float(self.optimizer.param_groups[0]["lr"])
        lr = next((x for x in (self._lr_at_step, self._lr_before) if x is not None), lr_after)
        self._lr_at_step = self._lr_before = None
        if math.isfinite(loss):
            self.best, self.last_loss = min(self.best, loss), loss
            self.steps_log.record(self.step, loss, lr, lr_next=lr_after, metrics=metrics)
            if self._metrics:
                self._metrics.write(json.dumps({"step": self.step, "loss": loss.hex()}) + "\n")
                self._metrics.flush()
        assert self._meter is not None
        logged = self._meter.tick(self.spec, self.step, loss, lr_after)
        copied = self.peer.acked if self.peer is not None else None
        self.opts.reporter.step(
            self.step, loss, self._meter.rate, self.ckpt.durable_step, force=logged, standby_step=copied
        )

    def _time_due(self) -> bool:
        tuned = self.tuner.choice.seconds if self.tuner is not None else None
        every_s = tuned or self.spec.checkpoint.every_seconds
        return every_s is not None and time.monotonic() - self.since_ckpt >= every_s

    def _timed(self, step_s: float, beside_save: bool) -> None:
        """`every: auto`: one step's time (begun beside a save or not) for the tuner."""
        if self.tuner is not None and (moved := self.tuner.step(step_s, beside_save)):
            self._report_interval(moved)

    def _checkpoint_due(self, by_time: bool) -> bool:
        """`by_time`: the clock said so at this step's agreement (any rank's clock, for ranks)."""
        pol = self.spec.checkpoint
        return (pol.every_steps is not None and self.step % pol.every_steps == 0) or by_time

    @contextlib.contextmanager
    def section(self, name: str) -> Iterator[None]:
        """A stretch that is no step, reported (rank 0) so that the watchdog does not time it as one."""
        if self.ranks.is_zero:
            self.opts.reporter.emit("section", name=name, begin=True, step=self.step)
        try:
            yield
        finally:
            if self.ranks.is_zero:
                self.opts.reporter.emit("section", name=name, begin=False, step=self.step)
            self._t_step = time.perf_counter()  # the next step's time leaves the section out

    def checkpoint(self, wait: bool = False) -> float:
        """Snapshot the full state and persist it; returns the seconds the loop was blocked."""
        t0 = time.perf_counter()
        if self.ranks.is_zero:  # the controller's watchdog times the save from here to its `durable`
            self.opts.reporter.emit("saving", step=self.step)
        self.ckpt.wait()  # (save's own first step) the last save's steps leave the buffer before this
        sidecars = self.steps_log.sidecars(self.step)  # object is cut: each step in one object
        self.ckpt.save(self.state.capture(), self._manifest_base(), wait=wait, sidecars=sidecars)
        blocked = time.perf_counter() - t0
        self.since_ckpt = time.monotonic()
        if self.tuner is not None:
            self.tuner.saved(blocked)
        return blocked

    def _manifest_base(self) -> dict[str, Any]:
        metrics = {k: v for k, v in (("loss", self.last_loss), ("best_loss", self.best)) if math.isfinite(v)}
        return {
            "step": self.step,
            "spec_hash": self.spec.spec_hash(),
            "shape_hash": self.spec.shape_hash(),
            "world_size": self.ranks.world_size,
            "metrics": metrics,
        }

    # ---- stopping ----

    @property
    def _stop_seen(self) -> bool:
        """One process: its own stop request. Ranks: only what they agreed on (one rank acting on its
        own flag would leave the others waiting in the next collective)."""
        return self.stop_agreed if self.ranks.distributed else self.opts.stop.requested

    def _stop_now(self) -> bool:
        """Stop at this step boundary? As `_stop_seen`, except that a noticed single process trains on
        through a handover first (trainer/preemption/handover.py)."""
        if self.ranks.distributed:
            return self.stop_agreed
        if not self.opts.stop.requested:
            return False
        return self.gate.may_stop(
            self.storage, self.step, lambda: self.gate.budget(self._cost(), self.last_step_s)
        )

    @property
    def _stop_reason(self) -> str:
        """This process's own reason; a rank that stopped on another's word says so."""
        return self.opts.stop.reason or "a stop request of another rank"

    def _cost(self) -> SaveCost:
        nbytes = self.ckpt.history[-1].nbytes if self.ckpt.history else state_nbytes(self.state.capture())
        return SaveCost.of(self.ckpt.bandwidth(), nbytes)

    def _stopping(self) -> None:
        """At the step boundary after a stop request: decide on the emergency checkpoint, report it."""
        stop, self.stop_reported = self.opts.stop, True
        reason = self._stop_reason
        fields: dict[str, Any] = {"reason": reason, "step": self.step}
        durable = self.ckpt.durable_step == self.step
        if stop.deadline is not None:
            self.plan = emergency_plan(
                stop=stop,
                cost=self._cost(),
                durable=durable,
                in_flight=self.ckpt.in_flight,
                margin_s=self.spec.preemption.save_margin_s,
                step=self.step,
            )
        self.plan = agreed_plan(self.plan, self.ranks)
        if self.plan is not None:
            fields |= {"save": self.plan.save, "save_reason": self.plan.reason, "deadline": stop.deadline}
            log.warning(
                "stop on %s at step %d: %s emergency checkpoint (%s)",
                reason,
                self.step,
                "taking an" if self.plan.save else "skipping the",
                self.plan.reason,
            )
        self.opts.reporter.emit("stopping", **fields)

    @property
    def _skip_save(self) -> bool:
        return self.plan is not None and not self.plan.save

    def finish(self, reason: str = "") -> None:
        """End the run here as completed (early stopping): the final checkpoint and COMPLETED.json follow."""
        log.info(
            "finishing at step %d of %d%s", self.step, self.spec.total_steps, f": {reason}" if reason else ""
        )
        self.finished_early = self.should_stop = True

    def _outcome(self) -> ExitCode:
        if self._skip_save:  # even at total_steps: completion needs the final checkpoint durable
            log.warning(
                "stopped on %s at step %d without an emergency checkpoint; newest durable step: %s",
                self._stop_reason,
                self.step,
                self.ckpt.durable_step,
            )
            return ExitCode.PREEMPTED
        if self.step >= self.spec.total_steps or self.finished_early:
            return ExitCode.COMPLETED
        if self._stop_seen:
            log.warning("stopped on %s at step %d; checkpoint durable", self._stop_reason, self.step)
            return ExitCode.PREEMPTED
        log.info(
            "stopped at --max-steps (step %d of %d); checkpoint durable", self.step, self.spec.total_steps
        )
        return ExitCode.STOPPED

    def close(self, evaluate: Callable[[torch.nn.Module], dict[str, float]] | None = None) -> AttemptResult:
        """The final (or max-steps, or emergency) checkpoint, synchronous: durable before the attempt
        ends; then COMPLETED.json (with the promotion gate's evaluation) when the job is done."""
        try:
            # a stop that landed before the first step, or between two epochs, is reported here
            if self._stop_seen and not self.stop_reported:
                self._stopping()
            # The one in flight lands first, so every rank sees the same durable step here.
            self.ckpt.wait()
            if self.ckpt.durable_step != self.step and not self._skip_save:
                blocked = self.checkpoint(wait=True)
                log.info("checkpoint at step %d durable after %.2fs", self.step, blocked)
            self.ckpt.wait()
        finally:
            self.abandon()
        code = self._outcome()
        if (
            code is ExitCode.COMPLETED and self.ranks.is_zero
        ):  # the promotion gate's evaluation: after the loop
            parts = self.parts_view(evaluate)
            mark_completed(
                self.storage, self.spec, self.step, evaluate_for_promotion(self.spec, parts, self.opts.cache)
            )
        return AttemptResult(
            code,
            self.step,
            self._selection_step,
            self.ckpt.durable_step,
            resharded_from=self.resharded_from,
            changes=self.changes,
        )

    def abandon(self) -> None:
        """Close the checkpointer and the metrics file, with no final checkpoint (an error ended it)."""
        if self.peer is not None:
            self.peer.close()
        if self._metrics:
            self._metrics.close()
            self._metrics = None
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        if hasattr(self, "ckpt"):
            self.ckpt.close()
