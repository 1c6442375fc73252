"""One training attempt: build, resume from the newest valid checkpoint, train, checkpoint, stop.

Order matters for bitwise-exact resume (shared/notes/torch.md §1.4): seed -> model -> optimizer ->
scheduler -> load their states -> data iterator for the epoch -> restore RNG -> first step.
"""

from __future__ import annotations

import json
import logging
import math
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file

from trainer import recipes
from trainer.catalog import Selection, find_resume_point, list_checkpoints, read_latest
from trainer.checkpointer import Checkpointer
from trainer.ckpt_format import COMPLETED, MODEL_FILE, load_part, rng_file
from trainer.data import ResumableLoader
from trainer.errors import ConfigError, ResumeIncompatible, TrainingDiverged
from trainer.exitcodes import ExitCode
from trainer.faults import Fault
from trainer.preemption import StopRequest
from trainer.recipes import Parts, RecipeContext
from trainer.spec import JobSpec
from trainer.state import capture_rng, restore_rng
from trainer.storage import Storage, get_bytes, put_bytes
from trainer.validate import Expectation

log = logging.getLogger(__name__)


@dataclass
class AttemptOptions:
    cache: Path  # local disk for checkpoint copies
    max_steps: int | None = None  # stop (with a checkpoint) after this many steps in this attempt's run
    metrics_path: Path | None = None  # per-step losses as JSON lines (float.hex, for exact comparisons)
    rank: int = 0
    world_size: int = 1
    stop: StopRequest = field(default_factory=StopRequest)
    resume_from: ResumeSource | None = None  # a specific checkpoint instead of the newest valid one
    fault: Fault | None = None  # injected failure (rehearsals, tests)


@dataclass(frozen=True)
class ResumeSource:
    """`--resume-from`: a step of this job's storage, or of another storage (a fork or a rollback)."""

    step: int
    storage: Storage | None = None  # None: the job's own storage


@dataclass
class AttemptResult:
    code: ExitCode
    step: int
    resumed_from: int | None
    durable_step: int | None
    message: str = ""


@dataclass
class _Progress:
    step: int = 0
    best: float = math.inf
    last_loss: float | None = None
    since_ckpt: float = field(default_factory=time.monotonic)


def run_attempt(spec: JobSpec, storage: Storage, opts: AttemptOptions) -> AttemptResult:
    """Train until done, preempted, or `max_steps`; raise on errors (the entry point maps them to codes)."""
    if spec.world_size != opts.world_size:
        raise ConfigError(
            f"world_size: spec says {spec.world_size}, launched with {opts.world_size}; make them equal"
        )
    done = _completed_step(storage)
    if done is not None and done >= spec.total_steps:
        log.info("job %s already completed at step %d (%s/%s)", spec.name, done, storage.uri, COMPLETED)
        return AttemptResult(ExitCode.COMPLETED, done, done, done, "already completed")
    device = _device(spec)
    _seed_everything(spec.seed)
    ctx = RecipeContext(spec.seed, spec.total_steps, spec.batch_size, device)
    parts = recipes.build(spec.recipe, spec.args, ctx)
    scaler = torch.amp.GradScaler(device.type) if spec.amp else None
    expect = Expectation.from_parts(parts.model, parts.optimizer, spec.shape_hash())

    selection = _select(storage, opts, expect)
    log.info(selection.describe(storage.uri))
    progress = _Progress()
    loader = ResumableLoader(
        parts.dataset, spec.batch_size, spec.seed, spec.num_workers, opts.rank, opts.world_size
    )
    rng_state = None
    threads = spec.threads or torch.get_num_threads()
    if selection.path is not None:
        meta, rng_state = _load_state(selection.path, parts, scaler, opts.rank)
        progress.step, progress.best = int(meta["step"]), float(meta["best_metric"])
        loader.position.load_state_dict(meta["position"])
        threads = spec.threads or int(meta["threads"])
        if int(meta["threads"]) != threads:
            log.warning(
                "thread count %d differs from the checkpoint's %d: results will drift",
                threads,
                meta["threads"],
            )
    torch.set_num_threads(threads)  # BLAS results differ bitwise across thread counts
    ckpt = Checkpointer(
        storage, opts.cache, spec.checkpoint.keep, spec.checkpoint.async_upload,
        pin_memory=device.type == "cuda", durable_step=_durable_here(selection, opts),
    )  # fmt: skip
    state = _StateView(spec, parts, scaler, loader, progress, device, threads, opts)
    end = (
        spec.total_steps if opts.max_steps is None else min(spec.total_steps, progress.step + opts.max_steps)
    )
    code = _train(spec, parts, scaler, loader, progress, ckpt, state, device, end, rng_state, opts)
    if code is ExitCode.COMPLETED:
        _mark_completed(storage, spec, progress.step)
    return AttemptResult(code, progress.step, selection.step, ckpt.durable_step)


def _train(
    spec: JobSpec,
    parts: Parts,
    scaler: torch.amp.GradScaler | None,
    loader: ResumableLoader,
    progress: _Progress,
    ckpt: Checkpointer,
    state: _StateView,
    device: torch.device,
    end: int,
    rng_state: dict[str, Any] | None,
    opts: AttemptOptions,
) -> ExitCode:
    parts.model.train()
    metrics = open(opts.metrics_path, "a") if opts.metrics_path else None  # noqa: SIM115 (closed below)
    meter = _Meter(progress.step)
    try:
        while progress.step < end and not opts.stop.requested:
            it = loader.epoch_iter()
            if rng_state is not None:  # after iter(): creating the iterator may draw from the global RNG
                restore_rng(rng_state, device)
                rng_state = None
            for batch in it:
                loss = _step(parts, scaler, batch, device, spec.amp, progress.step)
                progress.step += 1
                loader.position.batch += 1
                progress.best, progress.last_loss = min(progress.best, loss), loss
                if metrics:
                    metrics.write(json.dumps({"step": progress.step, "loss": loss.hex()}) + "\n")
                    metrics.flush()
                meter.tick(spec, progress.step, loss, parts)
                if opts.fault is not None:
                    opts.fault.maybe_fire(progress.step)
                ckpt.check()  # a background failure stops training here, not later
                if progress.step >= end or opts.stop.requested:
                    break
                if _checkpoint_due(spec, progress):
                    ckpt.save(state.capture(), state.manifest_base(loss))
                    progress.since_ckpt = time.monotonic()
            else:
                loader.position.epoch, loader.position.batch = loader.position.epoch + 1, 0
        # The final, max-steps and emergency checkpoints are all synchronous: exit only once durable.
        if ckpt.durable_step != progress.step:
            blocked = ckpt.save(state.capture(), state.manifest_base(progress.last_loss), wait=True)
            log.info("checkpoint at step %d durable after %.2fs", progress.step, blocked)
        ckpt.wait()
    finally:
        if metrics:
            metrics.close()
    if opts.stop.requested and progress.step < spec.total_steps:
        log.warning(
            "stopped on %s at step %d; checkpoint durable, exiting PREEMPTED", opts.stop.reason, progress.step
        )
        return ExitCode.PREEMPTED
    return ExitCode.COMPLETED if progress.step >= spec.total_steps else ExitCode.PREEMPTED


def _step(
    parts: Parts, scaler: torch.amp.GradScaler | None, batch: Any, device: torch.device, amp: bool, step: int
) -> float:
    dtype = torch.float16 if device.type == "cuda" else torch.bfloat16
    with torch.autocast(device.type, dtype=dtype, enabled=amp):
        loss = parts.loss_fn(parts.model, batch)
    value = float(loss.detach())
    if not math.isfinite(value):
        raise TrainingDiverged(
            f"loss is {value} at step {step + 1}; lower the learning rate or check the data"
        )
    parts.optimizer.zero_grad(set_to_none=True)
    if scaler is not None:
        scaler.scale(loss).backward()
        scaler.unscale_(parts.optimizer)
    else:
        loss.backward()
    if parts.grad_clip:
        torch.nn.utils.clip_grad_norm_(parts.model.parameters(), parts.grad_clip)
    if scaler is not None:
        scaler.step(parts.optimizer)
        scaler.update()
    else:
        parts.optimizer.step()
    parts.scheduler.step()
    return value


def _checkpoint_due(spec: JobSpec, p: _Progress) -> bool:
    pol = spec.checkpoint
    by_steps = pol.every_steps is not None and p.step % pol.every_steps == 0
    by_time = pol.every_seconds is not None and time.monotonic() - p.since_ckpt >= pol.every_seconds
    return by_steps or by_time


class _StateView:
    """The full training state as the checkpoint stores it."""

    def __init__(
        self,
        spec: JobSpec,
        parts: Parts,
        scaler: torch.amp.GradScaler | None,
        loader: ResumableLoader,
        progress: _Progress,
        device: torch.device,
        threads: int,
        opts: AttemptOptions,
    ) -> None:
        self.spec, self.parts, self.scaler, self.loader = spec, parts, scaler, loader
        self.progress, self.device, self.threads, self.opts = progress, device, threads, opts

    def capture(self) -> dict[str, Any]:
        p = self.parts
        return {
            "model": p.model.state_dict(),
            "optimizer": p.optimizer.state_dict(),
            "scheduler": p.scheduler.state_dict(),
            "scaler": self.scaler.state_dict() if self.scaler is not None else None,
            "rng": capture_rng(self.device),
            "trainer": {
                "step": self.progress.step,
                "position": self.loader.position.state_dict(),
                "best_metric": self.progress.best,
                "spec": self.spec.model_dump(mode="json"),
                "spec_hash": self.spec.spec_hash(),
                "shape_hash": self.spec.shape_hash(),
                "torch_version": str(torch.__version__),  # str(): TorchVersion is not weights_only-safe
                "threads": self.threads,
                "rank": self.opts.rank,
                "world_size": self.opts.world_size,
                "device": self.device.type,
            },
        }

    def manifest_base(self, loss: float | None) -> dict[str, Any]:
        metrics = {"best_loss": self.progress.best} if math.isfinite(self.progress.best) else {}
        if loss is not None:
            metrics["loss"] = loss
        return {
            "step": self.progress.step,
            "spec_hash": self.spec.spec_hash(),
            "shape_hash": self.spec.shape_hash(),
            "world_size": self.opts.world_size,
            "metrics": metrics,
        }


def _durable_here(selection: Selection, opts: AttemptOptions) -> int | None:
    """The resumed step is durable in this job's storage unless it came from another one (a fork)."""
    forked = opts.resume_from is not None and opts.resume_from.storage is not None
    return None if forked else selection.step


def _select(storage: Storage, opts: AttemptOptions, expect: Expectation) -> Selection:
    src = opts.resume_from
    source = src.storage if src is not None and src.storage is not None else storage
    selection = find_resume_point(source, opts.cache, expect, only_step=src.step if src else None)
    for r in selection.rejected:
        compat = [p for p in r.problems if p.kind == "compat"]
        if compat:
            raise ResumeIncompatible(
                f"checkpoint step {r.step} in {source.uri} {compat[0].detail}; "
                "use a new storage URI for a changed model, or restore the original settings"
            )
    if src is not None:
        _check_explicit_source(storage, source, src.step, selection)
    latest = read_latest(storage)
    if latest is not None and latest != selection.step and src is None:
        log.info("'latest' marker says step %d; newest valid is %s", latest, selection.step)
    return selection


def _check_explicit_source(storage: Storage, source: Storage, step: int, selection: Selection) -> None:
    if selection.step is None:
        why = selection.rejected[0].reason() if selection.rejected else "no such checkpoint"
        raise ConfigError(
            f"--resume-from: step {step} of {source.uri} is not usable ({why}); "
            "see 'spotrun checkpoints list'"
        )
    # Rolling back inside one storage would leave newer checkpoints of the abandoned timeline that a
    # later automatic resume would pick; they are committed work, so refuse rather than delete them.
    newer = [s for s, c in list_checkpoints(storage).items() if c.committed and s > step]
    if newer:
        raise ConfigError(
            f"--resume-from {step}: {storage.uri} holds newer checkpoints {sorted(newer)[:3]}; "
            "resume into a new storage (--storage NEW --resume-from OLD_URI/step_...)"
        )


def _load_state(
    path: Path, parts: Parts, scaler: torch.amp.GradScaler | None, rank: int
) -> tuple[dict[str, Any], dict[str, Any]]:
    parts.model.load_state_dict(load_file(str(path / MODEL_FILE)))
    parts.optimizer.load_state_dict(load_part(path / "optimizer.pt")["state"])
    parts.scheduler.load_state_dict(load_part(path / "scheduler.pt")["state"])
    if scaler is not None:
        scaler.load_state_dict(load_part(path / "scaler.pt")["state"])
    meta = load_part(path / "trainer.pt")["state"]
    return meta, load_part(path / rng_file(rank))["state"]


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


def _completed_step(storage: Storage) -> int | None:
    try:
        return int(json.loads(get_bytes(storage, COMPLETED))["step"])
    except FileNotFoundError:
        return None
    except (ValueError, KeyError, TypeError):
        log.warning("ignoring a malformed %s in %s", COMPLETED, storage.uri)
        return None


def _mark_completed(storage: Storage, spec: JobSpec, step: int) -> None:
    body = {"job": spec.name, "step": step, "spec_hash": spec.spec_hash(), "finished_at": time.time()}
    put_bytes(storage, COMPLETED, json.dumps(body).encode())
    log.info("job %s completed at step %d", spec.name, step)


class _Meter:
    def __init__(self, step: int) -> None:
        self.t, self.step = time.perf_counter(), step

    def tick(self, spec: JobSpec, step: int, loss: float, parts: Parts) -> None:
        if step % spec.log_every and step != spec.total_steps:
            return
        now = time.perf_counter()
        rate = (step - self.step) / max(now - self.t, 1e-9)
        lr = parts.optimizer.param_groups[0]["lr"]
        log.info("step %d/%d loss %.4f lr %.3g %.1f steps/s", step, spec.total_steps, loss, lr, rate)
        self.t, self.step = now, step
