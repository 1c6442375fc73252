"""One training attempt: build, resume from the newest valid checkpoint, train, checkpoint, stop.

A recipe's attempt is a loop over the session (trainer/session/core.py), the same step boundary a
user's own loop uses through `spotrun.session`; an entry point's attempt is the user's loop itself
(trainer/session/context.py). Order matters for bitwise-exact resume: seed -> model -> optimizer ->
scheduler -> load their states -> data iterator for the epoch -> restore RNG -> first step.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from spotrun.trainer import recipes
from spotrun.trainer.checkpoint.completion import completed_for
from spotrun.trainer.checkpoint.format import COMPLETED
from spotrun.trainer.errors import ConfigError
from spotrun.trainer.exitcodes import ExitCode
from spotrun.trainer.recipes import Parts, RecipeContext
from spotrun.trainer.recipes.job_shape import spec_shape_args
from spotrun.trainer.session.context import run_entrypoint
from spotrun.trainer.session.core import Session
from spotrun.trainer.session.options import AttemptOptions, AttemptResult, job_device, seed_everything
from spotrun.trainer.session.parts import wrapped
from spotrun.trainer.session.resume import ResumeSource as ResumeSource
from spotrun.trainer.spec.job import JobSpec
from spotrun.trainer.storage import Storage

log = logging.getLogger(__name__)

_device = job_device  # the entry point's name for it


def run_attempt(spec: JobSpec, storage: Storage, opts: AttemptOptions) -> AttemptResult:
    """Train until done, preempted, or `max_steps`; raise on errors (the entry point maps them to codes)."""
    done = completed_for(storage, spec)  # ConfigError: the storage holds another job, finished
    if done is not None:
        log.info("job %s already completed at step %d (%s/%s)", spec.name, done, storage.uri, COMPLETED)
        return AttemptResult(ExitCode.COMPLETED, done, done, durable_step=done, message="already completed")
    device = opts.ranks.device(job_device(spec))
    if spec.amp and opts.ranks.strategy == "fsdp":
        raise ConfigError(
            "amp: true is not supported with distributed.strategy: fsdp yet; use ddp or amp: false"
        )
    if spec.entrypoint is not None:  # the user's loop: imported, then seeded, then called
        return run_entrypoint(spec, storage, opts, device)
    assert spec.recipe is not None
    seed_everything(spec.seed)  # the same on every rank: FSDP2 shards each rank's copy of one init
    ctx = RecipeContext(spec.seed, spec.total_steps, spec.batch_size, device)
    parts = recipes.build(spec.recipe, spec.args, ctx)
    parts.model = wrapped(parts.model, parts.optimizer, spec, opts)
    scaler = torch.amp.GradScaler(device.type) if spec.amp else None
    s = Session(
        spec,
        storage,
        opts,
        model=parts.model,
        optimizer=parts.optimizer,
        scheduler=parts.scheduler,
        extra=parts.extra_state,
        device=device,
        scaler=scaler,
        shape_args=spec_shape_args(spec),
    ).open()
    try:
        for batch in s.batches(parts.dataset):
            s.step_done(recipe_step(parts, scaler, batch, device=device, amp=spec.amp))
    except BaseException:  # the attempt ends here (an error, Ctrl-C): no final checkpoint, the writer closed
        s.abandon()
        raise
    return s.close(parts.evaluate)


def recipe_step(
    parts: Parts, scaler: torch.amp.GradScaler | None, batch: Any, *, device: torch.device, amp: bool
) -> float:
    """One training step of a recipe: forward, backward, clip, update (the session's step pre-hook
    fences a background save's copy first), scheduler. Returns the loss."""
    dtype = torch.float16 if device.type == "cuda" else torch.bfloat16
    with torch.autocast(device.type, dtype=dtype, enabled=amp):
        loss = parts.loss_fn(parts.model, batch)
    value = float(loss.detach())  # a non-finite one is refused at the step boundary, before any checkpoint
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
    if parts.scheduler is not None:
        parts.scheduler.step()
    return value
