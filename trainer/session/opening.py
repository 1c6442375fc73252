"""Opening a session: claim the storage, choose and load the resume point, warm start at step 0.

The RNG is not applied here: it waits for the data iterator (Session.start), since creating one may
draw from the global RNG.
"""

from __future__ import annotations

import importlib
import logging
import time
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from spotrun.trainer.checkpoint.state import state_nbytes, update_only_views
from spotrun.trainer.checkpoint.validate import Expectation
from spotrun.trainer.errors import ConfigError
from spotrun.trainer.saving.checkpointer import Checkpointer
from spotrun.trainer.saving.interval import IntervalTuner
from spotrun.trainer.saving.peer import PeerReceiver, receiver_for, sender_for
from spotrun.trainer.session.options import rank_seed, seed_everything
from spotrun.trainer.session.parts import Meter, drop_lost_metrics, prior_cost_s
from spotrun.trainer.session.resume import Restored, durable_here, load_state, select_together
from spotrun.trainer.session.state import SessionState
from spotrun.trainer.session.warm_start import warm_start
from spotrun.trainer.spec.job import Change, describe_changes
from spotrun.trainer.telemetry.metrics_log import MetricsLog

if TYPE_CHECKING:
    from spotrun.trainer.saving import sharded

log = logging.getLogger("spotrun.trainer.session.loop")  # the loop's log name, which log readers match


def open_session(s: SessionState) -> None:
    """Claim the storage, choose and load the resume point (the RNG waits for the first batch), warm
    start at step 0, report where training starts from."""
    spec, opts, ranks = s.spec, s.opts, s.ranks
    if opts.claim is not None:
        if opts.prewarmed:  # the first optimizer step imports torch._dynamo: 0.8 s, paid while waiting
            importlib.import_module("torch._dynamo")  # `import torch._dynamo` here would shadow torch
        receiver = standby_receiver(s)
        try:  # resume and publish only through the storage this trainer holds
            s.storage = opts.claim(receiver.advert if receiver is not None else None)
            if receiver is not None:  # the worker it stood by for is gone: its newest copy, if newer
                receiver.commit(s.storage)
        finally:
            if receiver is not None:
                receiver.close()
    s.steps_log = MetricsLog(s.storage if ranks.is_zero else None)
    selection = select_together(s.storage, opts.cache, expectation(s), src=opts.resume_from, ranks=ranks)
    if ranks.is_zero:
        source = opts.resume_from.storage if opts.resume_from is not None else None
        log.info(selection.describe(source.uri if source is not None else s.storage.uri, into=s.storage.uri))
    if selection.world_size is not None:
        s.resharded_from = reshard(s, selection.world_size)
    s.ckpt = checkpointer(s, durable_here(selection, opts.resume_from))
    for opt in [
        s.optimizer,
        *(p for p in s.extra.values() if isinstance(p, torch.optim.Optimizer)),
    ]:
        s._hooks.append(opt.register_step_pre_hook(s._before_update))
    if selection.path is not None:
        s._pending = restore(s, selection.path)
    else:  # step 0: a warm start's source, never once the run has its own checkpoint
        started = warm_start(spec, s.parts_view(), opts.cache)
        s.warm_start = started.to_json() if started is not None else None
    if s.changes and ranks.is_zero:
        log.warning(
            "resuming step %d with changed training settings (%s), as resume.allow_changes allows: from "
            "here on the run is not bitwise equal to an uninterrupted one; the change is recorded in "
            "every checkpoint from now on",
            s.step,
            describe_changes(s.changes),
        )
    skip_data(s, dict(opts.skip_steps).get(selection.step or 0, 0))
    if ranks.is_zero:
        drop_lost_metrics(s.storage, s.step)
    torch.set_num_threads(s.threads)  # BLAS results differ bitwise across thread counts
    s.end = spec.total_steps if opts.max_steps is None else min(spec.total_steps, s.step + opts.max_steps)
    s.resumed_from, s._selection_step = selection.step, selection.step
    opts.reporter.emit(
        "started",
        resumed_from=selection.step,
        checkpoint=selection.uri,
        rejected=selection.rejected_records(),
        step=s.step,
        total_steps=spec.total_steps,
        resharded_from=s.resharded_from,
        changes=[c.as_dict() for c in s.changes] or None,
        warm_start=s.warm_start,
    )
    begin(s)


def standby_receiver(s: SessionState) -> PeerReceiver | None:
    """Where this trainer, waiting as a warm standby, takes copies of the running one's state
    (`checkpoint.standby_every_s`; one process only), else None."""
    if not (s.opts.prewarmed and s.spec.checkpoint.standby_every_s and not s.ranks.distributed):
        return None
    return receiver_for(s.state.capture(), s.opts.cache)


def skip_data(s: SessionState, steps: int) -> None:
    """A rollback's skip (tasks/control/rollback.py): the data of the next `steps` steps is passed over
    when `batches()` opens the stream, recorded as a trajectory change in every checkpoint from here."""
    if steps <= 0:
        return
    s.skip_steps = steps
    change = Change("data", f"from step {s.step}", f"{steps} steps' data skipped (rollback)", "trajectory")
    s.changes.append(change)
    s.change_log.append({"step": s.step, **change.as_dict()})
    if s.ranks.is_zero:
        first, last = s.step + 1, s.step + steps
        log.warning("rolled back to step %d: skipping the data of steps %d-%d", s.step, first, last)


def expectation(s: SessionState) -> Expectation:
    spec, ranks = s.spec, s.ranks
    return replace(
        Expectation.from_registry(s.state, spec.shape_hash(ranks.world_size)),
        shape_hash_at=spec.shape_hash,
        world_size=ranks.world_size,
        allow_reshard=spec.distributed is not None and spec.distributed.allow_reshard,
        spec=spec.model_dump(mode="json"),
        shape_args=s.shape_args,
        allow_changes=spec.resume.allow_changes,
    )


def checkpointer(s: SessionState, durable: int | None) -> Checkpointer | sharded.ShardedCheckpointer:
    spec, opts = s.spec, s.opts
    pin = s.device.type == "cuda"
    if spec.distributed is not None:
        from spotrun.trainer.saving.sharded import ShardedCheckpointer  # DCP: ~1 s of imports only ranks pay

        return ShardedCheckpointer(
            s.storage,
            opts.cache,
            spec.checkpoint.keep,
            registry=s.state,
            ranks=s.ranks,
            background=spec.checkpoint.async_upload,
            pin_memory=pin,
            durable_step=durable,
            on_durable=lambda step, written: on_durable(s, step, written),
            strategy=s.ranks.strategy,
        )
    return Checkpointer(
        s.storage,
        opts.cache,
        spec.checkpoint.keep,
        background=spec.checkpoint.async_upload,
        pin_memory=pin,
        durable_step=durable,
        on_durable=lambda step, written: on_durable(s, step, written),
        update_only=lambda: update_only_views(s.model, s.optimizer),
    )


def on_durable(s: SessionState, step: int, sidecars_written: bool) -> None:
    """A checkpoint is durable (called by the writer thread after `latest` moved, or by the loop)."""
    s.steps_log.written(step, sidecars_written)
    s.opts.reporter.emit("durable", step=step)


def reshard(s: SessionState, saved_world: int) -> int | None:
    """Resume a checkpoint of `saved_world` ranks on this many (validation allowed it): keep the
    global batch, so the position (batches done in the epoch) still counts the same samples."""
    world = s.ranks.world_size
    if saved_world == world:
        return None
    global_batch = s.spec.batch_size * saved_world
    if global_batch % world:
        raise ConfigError(
            f"cannot reshard {saved_world}->{world} ranks: the global batch {global_batch} "
            f"({s.spec.batch_size} x {saved_world}) does not divide by {world}; "
            "use a world size that divides it"
        )
    s.batch_size = global_batch // world
    if s.ranks.is_zero:
        log.warning(
            "resharded %d->%d ranks (not bitwise): global batch %d kept, %d per rank; "
            "RNG re-derived per rank",
            saved_world,
            world,
            global_batch,
            s.batch_size,
        )
    return saved_world


def restore(s: SessionState, path: Path) -> Restored:
    """Load every part but the RNG, which waits for the data iterator. A resharded resume re-derives
    each rank's RNG from (seed, rank, step) instead."""
    if s.state.sharded:
        from spotrun.trainer.saving.sharded import load_sharded

        load_sharded(path, s.state, s.ranks)
    restored = load_state(path, s.state, skip=("rng",) if s.resharded_from is not None else ())
    if s.resharded_from is not None:
        seed_everything(rank_seed(s.spec.seed + s.step, s.ranks.rank))
    return restored


def begin(s: SessionState) -> None:
    s.model.train()
    every, me = s.spec.checkpoint.standby_every_s, s.opts.worker_id
    if every and me and not s.ranks.distributed:  # copies to a warm standby, once one stands by
        size = state_nbytes(s.state.capture())
        s.peer = sender_for(s.storage, me, s.opts.cache, every_s=every, state_bytes=size)
    if s.spec.checkpoint.every == "auto":
        mtbf = s.opts.mtbf_s or s.spec.checkpoint.mtbf_prior_s
        s.tuner = IntervalTuner(mtbf, prior_cost_s(s.model))
        s._report_interval(s.tuner.choice)
    path = s.opts.metrics_path
    s._metrics = open(path, "a") if path else None  # noqa: SIM115 (closed in close())
    s._meter = Meter(s.step, quiet=not s.ranks.is_zero)
    s._t_step = time.perf_counter()
