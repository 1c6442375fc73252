"""Checkpoint benchmark, case (g): what a due checkpoint costs a user's own loop on `trainer.session`.

Cases (a)-(f) time the Checkpointer as the recipe loop used to drive it. A user's own loop reaches it
only through `Session.step_done()` (docs/your-loop.md), which does more on a checkpoint step: the
ranks' agreement, the step's metrics record, the metrics object the checkpoint carries (`sidecars`),
the registry's capture of every part, and the copy at the step boundary of whatever is not the
parameters or the optimizer state: here an EMA of the weights, a quarter of the state. And the copy
fence is an optimizer step pre-hook there, not a call in the loop. So this case runs the docs' loop
shape (forward, backward, clip, `optimizer.step()`, `scheduler.step()`, an EMA update, `s.step_done`)
around charlm at ~100 MB of state (model + AdamW moments + EMA; ~50 MB with --quick), with
`checkpoint.every_steps` making `step_done` take the checkpoints, to the same S3 (moto) as (a).

The stall of one checkpoint at step S is what (a) counts for the Checkpointer, at the session's seams:
the seconds the loop spent inside `step_done` on step S (the whole call, its ordinary bookkeeping
included) plus the seconds the next step's `optimizer.step()` waited in the session's pre-hook (the
fence: timed by a pre-hook registered before the session's and one registered after it). The baseline,
measured in the same run: `torch.save` of the same captured state + fsync + boto3 `upload_file`, all
blocking (as (a)'s). `session_stall_ratio` = baseline / session stall, medians, the first checkpoint
left out (it starts the writer process and allocates the shared buffers). Before a due step the
harness waits for a save still in flight, outside the timing, as (a) does: the stall of a checkpoint,
not the wait for the one before it (how often that happened is reported). As a cross-check the two
steps around each checkpoint are timed whole against two of the others after the first checkpoint
(their median; warmed up, and many of them beside a background save too): a cost the seams miss, or
the background write taking more from those two steps than from the rest, would show there.
"""

from __future__ import annotations

import os
import shutil
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn

from spotrun.trainer import recipes
from spotrun.trainer.saving.checkpointer import Checkpointer
from spotrun.trainer.session import AttemptOptions, Session
from spotrun.trainer.spec.job import CheckpointPolicy, JobSpec
from spotrun.trainer.storage import Storage
from spotrun.trainer.storage.options import S3Options


@dataclass(frozen=True)
class Plan:
    d_model: int
    n_layers: int
    every: int  # checkpoint.every_steps
    reps: int  # measured checkpoints, after the first


FULL = Plan(d_model=320, n_layers=5, every=16, reps=5)  # 102 MB with the EMA: the writer process
QUICK = Plan(d_model=256, n_layers=4, every=10, reps=3)  # 53 MB: the writer thread
BATCH = 4
SYNC_REPS = 3


class S3Target(Protocol):
    """The bench's moto endpoint (bench/checkpoint.py's S3): spotrun's storage and a plain client."""

    opts: S3Options
    plain: Any

    def storage(self, prefix: str) -> Storage: ...


class EMA:
    """docs/your-loop.md's EMA of the weights: an `extra` part, copied at the step boundary."""

    def __init__(self, model: nn.Module, decay: float = 0.99) -> None:
        self.decay = decay
        self.shadow = {k: v.detach().clone() for k, v in model.state_dict().items()}

    @torch.no_grad()
    def update(self, model: nn.Module) -> None:
        """Move the shadow toward the model's weights."""
        for k, v in model.state_dict().items():
            self.shadow[k].mul_(self.decay).add_(v, alpha=1 - self.decay)

    def state_dict(self) -> dict[str, Any]:
        return {"decay": self.decay, "shadow": self.shadow}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.decay, self.shadow = state["decay"], dict(state["shadow"])


@dataclass
class Step:
    """One iteration of the user's loop, timed at the session's seams."""

    step: int  # s.step after step_done
    iter_s: float  # the whole iteration: forward to step_done's return
    done_s: float  # inside s.step_done
    fence_s: float  # inside the session's optimizer step pre-hook (the copy fence)
    beside_save: bool  # a background save was in flight when the iteration began
    checkpoint: bool  # step_done took a checkpoint


@dataclass
class FenceClock:
    """Two optimizer step pre-hooks around the session's: the seconds its hook (the fence) took."""

    t0: float = 0.0
    waits: list[float] = field(default_factory=list)

    def before(self, *_: Any) -> None:
        self.t0 = time.perf_counter()

    def after(self, *_: Any) -> None:
        self.waits.append(time.perf_counter() - self.t0)


def build(quick: bool, s3: S3Target, prefix: str, bucket: str) -> tuple[JobSpec, recipes.Parts]:
    """The job as a user's entry point job would declare it, and charlm's parts (model first, seeded)."""
    plan = QUICK if quick else FULL
    args = {"d_model": plan.d_model, "n_layers": plan.n_layers, "seq_len": 64, "dropout": 0.0}
    spec = JobSpec(
        name="bench-session",
        entrypoint="bench.session_case:main",
        args=args,
        total_steps=plan.every * (plan.reps + 1) + 2,
        batch_size=BATCH,
        device="cpu",
        threads=torch.get_num_threads(),
        checkpoint=CheckpointPolicy(every_steps=plan.every, keep=2),
        storage=f"s3://{bucket}/{prefix}",
        s3=s3.opts,
    )
    torch.manual_seed(spec.seed)
    ctx = recipes.RecipeContext(spec.seed, spec.total_steps, spec.batch_size, torch.device("cpu"))
    return spec, recipes.build("charlm", args, ctx)


def user_loop(s: Session, parts: recipes.Parts, ema: EMA, fences: FenceClock) -> tuple[list[Step], int]:
    """docs/your-loop.md's loop around charlm; returns its steps and the saves waited for before a due
    step (outside the timing)."""
    opt, sched, every = parts.optimizer, parts.scheduler, s.spec.checkpoint.every_steps
    assert sched is not None and every is not None
    steps, waited = [], 0
    for batch in s.batches(parts.dataset):
        if (s.step + 1) % every == 0 and s.ckpt.in_flight:
            waited += 1
            s.ckpt.wait()  # the harness's, as (a)'s ckpt.wait(): time the checkpoint, not the one before
        beside, n_fences = s.ckpt.in_flight, len(fences.waits)
        t0 = time.perf_counter()
        loss = parts.loss_fn(s.model, batch)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(s.model.parameters(), 1.0)
        opt.step()
        sched.step()
        ema.update(s.model)
        t1 = time.perf_counter()
        s.step_done(loss.item())
        t2 = time.perf_counter()
        fence = sum(fences.waits[n_fences:])
        steps.append(
            Step(
                s.step,
                t2 - t0,
                t2 - t1,
                fence_s=fence,
                beside_save=beside,
                checkpoint=s.step % every == 0 and not s.should_stop,
            )
        )
    return steps, waited


def sync_save_upload(state: dict[str, Any], client: Any, bucket: str, *, path: Path, key: str) -> float:
    """The plain way, as (a)'s baseline: torch.save the whole state, fsync, boto3 upload_file."""
    t0 = time.perf_counter()
    with open(path, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    client.upload_file(str(path), bucket, key)
    elapsed = time.perf_counter() - t0
    path.unlink()
    return elapsed


def part_bytes(state: dict[str, Any]) -> dict[str, int]:
    """Bytes of tensors in each captured part."""

    def size(x: Any) -> int:
        if isinstance(x, torch.Tensor):
            return x.numel() * x.element_size()
        if isinstance(x, dict):
            return sum(size(v) for v in x.values())
        if isinstance(x, list | tuple):
            return sum(size(v) for v in x)
        return 0

    return {name: size(part) for name, part in state.items()}


def measure_session(s3: S3Target, bucket: str, work: Path, quick: bool) -> dict[str, Any]:
    """Run the user's loop on a session saving to S3, then the synchronous baseline of the same state."""
    t0 = time.perf_counter()
    prefix = "session-quick" if quick else "session"
    spec, parts = build(quick, s3, prefix, bucket)
    run = run_session(spec, parts, s3.storage(prefix), work / "cache-session")
    s, state = run.session, run.session.state.capture()
    sync = [
        sync_save_upload(state, s3.plain, bucket, path=work / "sync-session.pt", key=f"{prefix}/sync.pt")
        for _ in range(SYNC_REPS)
    ]
    shutil.rmtree(work / "cache-session", ignore_errors=True)
    out = summarize_steps(run.steps, statistics.median(sync))
    return out | {
        "state_bytes": sum(part_bytes(state).values()),
        "part_bytes": part_bytes(state),
        "sync_stalls_s": sync,
        "writer": run.writer,
        "waited_for_previous": run.waited,
        "snapshot_s": [h.snapshot_s for h in s.ckpt.history[:-1]],  # the last: close()'s, synchronous
        "close_s": run.close_s,
        "every_steps": spec.checkpoint.every_steps,
        "steps": len(run.steps),
        "prefix": prefix,
        "wall_s": time.perf_counter() - t0,
    }


@dataclass
class Ran:
    session: Session
    steps: list[Step]
    waited: int  # saves still in flight at a due step, waited for outside the timing
    writer: str  # where the background saves ran: "process" or "thread"
    close_s: float  # close(): the final checkpoint, durable


def run_session(spec: JobSpec, parts: recipes.Parts, storage: Storage, cache: Path) -> Ran:
    """Open the session (fence clock hooks on either side of its own), run the loop, close it."""
    ema, fences = EMA(parts.model), FenceClock()
    parts.optimizer.register_step_pre_hook(fences.before)  # runs before the session's pre-hook
    s = Session(
        spec,
        storage,
        AttemptOptions(cache=cache),
        model=parts.model,
        optimizer=parts.optimizer,
        scheduler=parts.scheduler,
        extra={"ema": ema},
        device=torch.device("cpu"),
    ).open()
    parts.optimizer.register_step_pre_hook(fences.after)  # ... and this one after it
    try:
        steps, waited = user_loop(s, parts, ema, fences)
    except BaseException:
        s.abandon()
        raise
    writer = "process" if isinstance(s.ckpt, Checkpointer) and s.ckpt.uses_process else "thread"
    c0 = time.perf_counter()
    s.close()
    return Ran(s, steps, waited, writer=writer, close_s=time.perf_counter() - c0)


def summarize_steps(steps: list[Step], sync_s: float) -> dict[str, Any]:
    """The stall per checkpoint (step_done on its step + the next step's fence), first one left out."""
    at = [i for i, st in enumerate(steps) if st.checkpoint and i + 1 < len(steps)]
    measured = at[1:]
    done = [steps[i].done_s for i in measured]
    fence = [steps[i + 1].fence_s for i in measured]
    stalls = [d + f for d, f in zip(done, fence, strict=True)]
    after = {i + 1 for i in at}
    plain = [st for i, st in enumerate(steps[at[0] :], at[0]) if not (st.checkpoint or i in after)]
    base_iter = statistics.median(st.iter_s for st in plain)
    excess = [steps[i].iter_s + steps[i + 1].iter_s - 2 * base_iter for i in measured]
    stall = statistics.median(stalls)
    return {
        "session_stall_s": stall,
        "session_stalls_s": stalls,
        "step_done_s": done,
        "fence_waits_s": fence,
        "first_stall_s": steps[at[0]].done_s + steps[at[0] + 1].fence_s,
        "plain_step_done_s": statistics.median(st.done_s for st in plain),
        "plain_fence_s": statistics.median(st.fence_s for st in plain),
        "base_step_s": base_iter,
        "step_excess_s": excess,
        "sync_stall_s": sync_s,
        "session_stall_ratio": sync_s / stall,
    }


def report_session(g: dict[str, Any], say: Callable[[str], None], verdict: Callable[[bool], str]) -> None:
    """(g)'s lines, in the bench's voice."""
    ratio, mb = g["session_stall_ratio"], g["part_bytes"]
    parts = ", ".join(f"{k} {v / 1e6:.0f}" for k, v in mb.items() if v >= 1e6)
    say(
        f"(g) session: docs/your-loop.md's loop on charlm, {g['state_bytes'] / 1e6:.0f} MB of state ({parts} "
        f"MB), a checkpoint every {g['every_steps']} steps to S3 ({g['writer']} writer), {g['steps']} steps"
    )
    say(
        f"(g) stall per checkpoint: step_done + the next step's fence {g['session_stall_s'] * 1e3:.1f} ms "
        f"(median of {len(g['session_stalls_s'])}: step_done {fmt_ms(g['step_done_s'])} ms, fence "
        f"{fmt_ms(g['fence_waits_s'])} ms) vs torch.save+fsync+upload_file {g['sync_stall_s']:.2f}s "
        f"(median of {len(g['sync_stalls_s'])}) -> {ratio:.0f}x {verdict(ratio >= 50)} (>= 50)"
    )
    plain = f"step_done {g['plain_step_done_s'] * 1e6:.0f} us, pre-hook {g['plain_fence_s'] * 1e6:.0f} us"
    say(
        f"(g)     a step (median): {g['base_step_s'] * 1e3:.0f} ms, {plain}; the first checkpoint (writer "
        f"start, buffers) {g['first_stall_s'] * 1e3:.0f} ms; snapshots {fmt_ms(g['snapshot_s'])} ms (the "
        "overlapped copy included)"
    )
    say(
        "(g)     cross-check, the two steps around a checkpoint timed whole against two others: "
        f"{fmt_ms(g['step_excess_s'])} ms; saves in flight "
        f"at a due step: {g['waited_for_previous']}; close (final checkpoint, durable) {g['close_s']:.2f}s"
    )


def fmt_ms(xs: list[float]) -> str:
    return "/".join(f"{x * 1e3:.1f}" for x in xs)
