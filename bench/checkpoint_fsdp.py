"""One rank of the 2-rank FSDP2 checkpoint case of bench/checkpoint.py (run under torchrun, gloo on CPU).

Each rank builds charlm, shards it with FSDP2 (trainer.distributed.ranks.wrap) and takes two AdamW steps so
the optimizer state exists. Then, interleaved `--reps` times (a change in machine load hits both):

  spotrun   ShardedCheckpointer(LocalStorage, background=True).save(wait=False): the stall is the
            time that call blocks this rank's loop; time-to-durable runs from the call until `wait()`
            returns (the manifest is written, read back and `latest` moved), with the loop idle.
  baseline  the common way: get_model_state_dict / get_optimizer_state_dict with
            full_state_dict=True, cpu_offload=True gathered to rank 0, which torch.saves the whole
            state (plus scheduler, its RNG, trainer meta) to one file in the same storage directory
            and fsyncs it, while rank 1 waits at a barrier. The loop is blocked until it is durable,
            so its stall and its time-to-durable are the same number.

Each repetition also runs the same sharded save with wait=True (all of it on the main thread at
normal priority), to tell the writer thread's low priority apart from the work itself.

Times are the slowest rank's per repetition; rank 0 writes the medians (the ratios use these) and
the fastest over repetitions, every repetition, and a breakdown by phase (stage, DCP write, hashing,
upload, commit; gather vs save; each phase also timed alone) as one JSON object to `--out`.
Run it through bench/checkpoint.py (`--only fsdp`), or directly:

    OMP_NUM_THREADS=1 PYTHONPATH=. .venv/bin/python -m torch.distributed.run --standalone \\
        --nproc_per_node 2 bench/checkpoint_fsdp.py --out /tmp/fsdp.json --dir /tmp/fsdp-work
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
)

from spotrun.trainer import recipes
from spotrun.trainer.checkpoint.state import RngState, iter_tensors, local_of
from spotrun.trainer.checkpoint.stateful import Registry, Stateful
from spotrun.trainer.distributed.ranks import Ranks, wrap
from spotrun.trainer.recipes.charlm import state_bytes
from spotrun.trainer.saving.sharded import ShardedCheckpointer, dcp_state
from spotrun.trainer.spec.job import DistributedOptions, JobSpec
from spotrun.trainer.storage import LocalStorage
from spotrun.trainer.storage.digests import digest_file
from spotrun.trainer.storage.local import copy_durable, fsync_dir


class TrainerMeta:
    """The registry's `trainer` part, as trainer/session/loop.py's `_Run` holds it
    (step, position, spec...)."""

    def __init__(self, spec: JobSpec, ranks: Ranks) -> None:
        self.spec, self.ranks, self.step = spec, ranks, 0

    def state_dict(self) -> dict[str, Any]:
        s = self.spec
        return {
            "step": self.step,
            "position": {"epoch": 0, "batch": self.step},
            "best_metric": 0.0,
            "spec": s.model_dump(mode="json"),
            "spec_hash": s.spec_hash(),
            "shape_hash": s.shape_hash(),
            "torch_version": str(torch.__version__),
            "threads": torch.get_num_threads(),
            "rank": self.ranks.rank,
            "world_size": self.ranks.world_size,
            "device": "cpu",
        }

    def load_state_dict(self, meta: dict[str, Any]) -> None:
        self.step = int(meta["step"])

    def manifest_base(self) -> dict[str, Any]:
        s = self.spec
        return {
            "step": self.step,
            "spec_hash": s.spec_hash(),
            "shape_hash": s.shape_hash(),
            "world_size": self.ranks.world_size,
            "metrics": {},
        }


class Trainee:
    """charlm under FSDP2 on this rank, training on a few cycled batches of its own."""

    def __init__(self, cli: argparse.Namespace, ranks: Ranks) -> None:
        args = {"d_model": cli.d_model, "n_layers": cli.n_layers, "seq_len": 64, "dropout": 0.0}
        self.args = args
        self.spec = JobSpec(
            name="bench-fsdp",
            recipe="charlm",
            args=args,
            total_steps=100_000,
            batch_size=cli.batch_size,
            threads=1,
            distributed=DistributedOptions(nproc_per_node=ranks.world_size, strategy="fsdp"),
        )
        torch.manual_seed(0)  # the same init on every rank: FSDP2 shards one model
        ctx = recipes.RecipeContext(0, self.spec.total_steps, cli.batch_size, torch.device("cpu"))
        self.parts = recipes.build("charlm", args, ctx)
        self.parts.model = wrap(self.parts.model, self.parts.optimizer, ranks)
        n, r, w = cli.batch_size, ranks.rank, ranks.world_size
        self.batches = [
            torch.utils.data.default_collate([self.parts.dataset[(b * w + r) * n + i] for i in range(n)])
            for b in range(4)
        ]
        self.meta = TrainerMeta(self.spec, ranks)
        p = self.parts
        assert p.scheduler is not None  # charlm schedules its rate
        held: dict[str, Stateful] = {"model": p.model, "optimizer": p.optimizer, "scheduler": p.scheduler}
        held |= {"rng": RngState(torch.device("cpu")), "trainer": self.meta}
        self.registry = Registry(ranks.rank, held, {}, sharded=True)

    def train_step(self, fence: Callable[[], float] = lambda: 0.0) -> float:
        """One step, as trainer/session/loop.py's: `fence` just before the update.
        Returns the fence's wait."""
        p = self.parts
        loss = p.loss_fn(p.model, self.batches[self.meta.step % len(self.batches)])
        p.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(p.model.parameters(), 1.0)
        waited = fence()
        p.optimizer.step()
        assert p.scheduler is not None  # charlm schedules its rate
        p.scheduler.step()
        self.meta.step += 1
        return waited

    def shard_bytes(self) -> int:
        """This rank's bytes of model + optimizer state (its DTensor shards)."""
        total = 0
        for _, t in iter_tensors(dcp_state(self.registry)):
            local = local_of(t)
            total += local.numel() * local.element_size() if local.dim() > 0 else 0
        return total


# ---------------------------------------------------------------- the two ways


class DurableClock:
    """The checkpointer's on_durable hook: when this rank learned the step is durable, before the
    retention and local pruning that `wait()` also waits for."""

    def __init__(self) -> None:
        self.at = 0.0

    def __call__(self, step: int, sidecars_written: bool) -> None:
        self.at = time.perf_counter()


def spotrun_save(t: Trainee, ckpt: ShardedCheckpointer, clock: DurableClock) -> dict[str, float]:
    """One background sharded checkpoint on this rank: time-to-durable (until `wait()` returns) and
    when the durable verdict arrived (`on_durable`), both from the save call."""
    t0 = time.perf_counter()
    ckpt.save(t.registry.capture(), t.meta.manifest_base(), wait=False)
    ckpt.wait()
    return {"durable": time.perf_counter() - t0, "verdict": clock.at - t0}


def spotrun_stall(t: Trainee, ckpt: ShardedCheckpointer, plain_step_s: float) -> dict[str, float]:
    """The loop's stall for one background sharded checkpoint: the save call, plus the next step's
    wait at the fence before its update (the parameters and optimizer state are copied during that
    step's forward and backward). `step_slowdown_s`: how much longer that step took than `plain_step_s`
    beside the copy and the write, its fence included."""
    t0 = time.perf_counter()
    ckpt.save(t.registry.capture(), t.meta.manifest_base(), wait=False)
    t1 = time.perf_counter()
    fence = t.train_step(ckpt.fence)
    t2 = time.perf_counter()
    ckpt.wait()
    return {
        "stall": t1 - t0 + fence,
        "save_call": t1 - t0,
        "fence": fence,
        "step_slowdown_s": t2 - t1 - plain_step_s,
    }


def sync_save(t: Trainee, ckpt: ShardedCheckpointer) -> float:
    """The same sharded checkpoint with wait=True: every phase on the main thread at normal priority
    (the background writer runs at nice 10), so the two tell how much of time-to-durable is priority."""
    t0 = time.perf_counter()
    ckpt.save(t.registry.capture(), t.meta.manifest_base(), wait=True)
    return time.perf_counter() - t0


def gathered_save(t: Trainee, ranks: Ranks, root: Path) -> dict[str, float]:
    """The common baseline, blocking every rank until rank 0's file is durable: full state dict
    gathered to rank 0 (CPU), torch.save + fsync there, a new file per step as the sharded
    checkpoints are (the previous one is deleted afterwards, untimed). torch.save runs without its
    CRC32s, as BackgroundSaver turns them off process-wide: a faster baseline than torch's default.
    Returns {gather, save, total} seconds."""
    p, path = t.parts, root / f"full_state_step_{t.meta.step}.pt"
    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    t0 = time.perf_counter()
    msd = get_model_state_dict(p.model, options=opts)
    osd = get_optimizer_state_dict(p.model, p.optimizer, options=opts)
    t1 = time.perf_counter()
    if ranks.rank == 0:
        assert p.scheduler is not None
        full = {
            "model": msd,
            "optimizer": osd,
            "scheduler": p.scheduler.state_dict(),
            "rng": RngState(torch.device("cpu")).state_dict(),
            "trainer": t.meta.state_dict(),
        }
        with open(path, "wb") as f:
            torch.save(full, f)
            f.flush()
            os.fsync(f.fileno())
        fsync_dir(path.parent)
    t2 = time.perf_counter()
    dist.barrier()  # rank 1's loop waits for the durable file too
    t3 = time.perf_counter()
    if ranks.rank == 0:
        for old in root.glob("full_state_step_*.pt"):
            if old != path:
                old.unlink()
    return {"gather": t1 - t0, "save": t2 - t1, "total": t3 - t0}


# ---------------------------------------------------------------- phases, measured apart


def timed(fn: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def phase_profile(t: Trainee, ranks: Ranks, work: Path) -> dict[str, float]:
    """What each step of the sharded save costs on this rank, run one at a time and synchronously, so
    a missed goal can be put on a phase: get_state_dict, DCP save (plan + write + fsync), hashing
    this rank's shard, copying it into the storage directory (copy + fsync), reading it back."""
    scratch = work / "profile"
    shutil.rmtree(scratch, ignore_errors=True)
    dist.barrier()
    out = {"get_state_dict": timed(lambda: dcp_state(t.registry))}
    shards = dcp_state(t.registry)
    out["dcp_save"] = timed(
        lambda: dcp.save(shards, checkpoint_id=str(scratch), process_group=ranks.ckpt_group)
    )
    own = scratch / f"__{ranks.rank}_0.distcp"
    out["hash_shard"] = timed(lambda: digest_file(own))
    out["copy_durable_shard"] = timed(lambda: copy_durable(own, work / "profile-remote" / own.name))
    out["read_back_shard"] = timed(lambda: digest_file(work / "profile-remote" / own.name))
    out["shard_mb"] = own.stat().st_size / 1e6
    dist.barrier()
    if ranks.rank == 0:
        shutil.rmtree(scratch, ignore_errors=True)
    shutil.rmtree(work / "profile-remote", ignore_errors=True)
    return out


# ---------------------------------------------------------------- driver


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="rank 0 writes the results here (JSON)")
    ap.add_argument("--dir", type=Path, required=True, help="work directory (storage, cache, baseline)")
    ap.add_argument("--d-model", type=int, default=384)
    ap.add_argument("--n-layers", type=int, default=5)
    ap.add_argument("--batch-size", type=int, default=4, help="per rank")
    ap.add_argument("--reps", type=int, default=5, help="measured repetitions of each way")
    cli = ap.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    ranks = Ranks(
        rank,
        world,
        int(os.environ.get("LOCAL_RANK", rank)),
        strategy="fsdp",
        ckpt_group=dist.new_group(backend="gloo"),
    )
    t_build = time.perf_counter()
    t = Trainee(cli, ranks)
    t.train_step()
    t.train_step()  # AdamW's exp_avg / exp_avg_sq exist from the first step on
    build_s = time.perf_counter() - t_build

    remote = LocalStorage(cli.dir / "storage")
    cache = cli.dir / "cache"
    clock = DurableClock()
    ckpt = ShardedCheckpointer(
        remote, cache, 2, registry=t.registry, ranks=ranks, background=True, on_durable=clock, strategy="fsdp"
    )

    spotrun_save(t, ckpt, clock)  # the first save sets up DCP's stager and the files' directories
    gathered_save(t, ranks, remote.root)
    plain_step_s = statistics.median(timed(t.train_step) for _ in range(3))
    reps: list[dict[str, Any]] = []
    for _ in range(cli.reps):  # interleaved, so a change in machine load hits all four alike
        t.train_step()
        spot = spotrun_save(t, ckpt, clock)
        timings = ckpt.history[-1]
        spot |= spotrun_stall(t, ckpt, plain_step_s)
        t.train_step()
        base = gathered_save(t, ranks, remote.root)
        t.train_step()
        sync = sync_save(t, ckpt)
        reps.append(
            {
                **spot,
                "stage": timings.snapshot_s,
                "write_hash": timings.write_s,
                "upload": timings.upload_s,
                "commit": timings.verify_s,
                "sync_durable": sync,
                "base_gather": base["gather"],
                "base_save": base["save"],
                "base_total": base["total"],
            }
        )
    ckpt.close()
    profile = phase_profile(t, ranks, cli.dir)
    mine = {"reps": reps, "profile": profile, "shard_bytes": t.shard_bytes(), "build_s": build_s}
    everyone = ranks.gather(mine)
    if everyone is not None:
        files = sorted(remote.root.glob("step_*"))
        ckpt_bytes = sum(f.stat().st_size for f in files[-1].iterdir()) if files else 0
        base_bytes = sum(f.stat().st_size for f in remote.root.glob("full_state_step_*.pt"))
        cli.out.write_text(json.dumps(summarize(everyone, t, ckpt_bytes, base_bytes)))
    dist.barrier()
    dist.destroy_process_group()


def summarize(per_rank: list[dict[str, Any]], t: Trainee, ckpt_bytes: int, base_bytes: int) -> dict[str, Any]:
    """Per repetition the slowest rank; over repetitions the median."""
    n = len(per_rank[0]["reps"])
    worst = [{k: max(r["reps"][i][k] for r in per_rank) for k in per_rank[0]["reps"][i]} for i in range(n)]
    med = {k: statistics.median(w[k] for w in worst) for k in worst[0]}
    best = {k: min(w[k] for w in worst) for k in worst[0]}
    return {
        "world_size": len(per_rank),
        "args": t.args,
        "batch_size": t.spec.batch_size,
        "state_bytes": sum(r["shard_bytes"] for r in per_rank),
        "estimate_bytes": state_bytes(t.args),
        "checkpoint_bytes": ckpt_bytes,
        "baseline_file_bytes": base_bytes,
        "build_s": max(r["build_s"] for r in per_rank),
        "reps": n,
        "median": med,
        "best": best,
        "worst_rank_each": worst,
        "profile": {k: max(r["profile"][k] for r in per_rank) for k in per_rank[0]["profile"]},
        "stall_ratio": med["base_total"] / med["stall"],
        "durable_ratio": med["durable"] / med["base_total"],
    }


if __name__ == "__main__":
    main()
