"""Checkpoint benchmark: what spotrun's checkpointing costs a training loop, next to the plain way.

For each state size (charlm model + AdamW state; ~100 MB and ~1 GB, or ~10/50 MB with --quick):
  (a) stall: Checkpointer.save(wait=False) to S3 (moto on 127.0.0.1) vs torch.save + fsync +
      boto3 upload_file to the same endpoint, timed from state capture to return. Goal ratio >= 50.
      Then a notice: an emergency save (wait=True, nothing in flight) timed to durable in S3,
      `durable_after_notice_s` (of the largest state), next to the plain torch.save + upload_file.
  (b) overhead: the loop time one async checkpoint costs (LocalStorage standing in for a network
      volume): its stall, plus how much longer the steps beside the background save took than the
      run's other steps, plus any wait at the end. Amortized over one checkpoint per 60 s of
      training. Goal <= 2 %. Whole runs with vs without a checkpoint are printed as a cross-check.
      Measured for the writer process (`overhead_pct`, what states of 64 MB and more get) and for
      the writer thread (`thread_overhead_pct`, the baseline: what every state got before).
  (c) validation: validate_dir on a written checkpoint vs a plain safetensors/torch.load of the same
      files, page cache warm for both. Goal <= 1.5x.
Then once:
  (d) transfer: S3Storage.put/get vs one boto3 put_object/get_object of the same bytes. Goal >= 1.
  (e) fsdp: 2 gloo ranks under torchrun (bench/checkpoint_fsdp.py), charlm sharded with FSDP2, ~100 MB
      of state (~20 MB with --quick). ShardedCheckpointer.save(wait=False) to a LocalStorage dir vs
      the common way: the full state dict gathered to rank 0 (cpu_offload) and torch.save + fsync
      there, the other rank at a barrier. Stall (the slowest rank's) ratio baseline/spotrun, goal
      >= 50; time-to-durable ratio spotrun/baseline, goal <= 0.7. Medians of interleaved runs.
And for the largest state, in the same run:
  (f) signing: what `SPOTRUN_MANIFEST_KEY` costs. With a key, the writer also computes a keyed BLAKE3
      digest of every file as it writes it and signs the manifest, and validation checks the keyed
      digest instead of xxh3. Two writer-process checkpointers, one started with the key in its
      environment and one without, take turns (medians of a few interleaved (b)-style runs each).
      `signed_overhead_pct` is the extra loop time of one async checkpoint with the key, as a
      percentage of the same without it: the loop's cost is the honest "overhead", as in (b), since
      it is what training pays. The hash runs in the writer, off the loop; the loop pays for it
      through the CPU the writer takes beside the steps and a longer save. Beside it:
      `signed_durable_pct`, what the key adds to the time from the save call to durable (the window
      a preemption can lose), and `signed_writer_cpu_pct`, what it adds to the writer's CPU seconds
      per save: the figure least moved by other work on the machine. Where that work drowns the
      loop's figure (the unkeyed median <= 0 s), `signed_overhead_pct` is null and those two say what
      the key costs. Then validate_dir with the key (keyed digests) vs without it (xxh3), page
      cache warm, as `signed_validate_ratio`. Goal: a few percent.
Then once, with the same S3:
  (g) session: a user's own loop (docs/your-loop.md: forward, backward, optimizer.step, scheduler.step,
      an EMA in `extra`, `s.step_done(loss)`) on charlm at ~100 MB of state (model + AdamW + EMA; ~50 MB
      with --quick), `step_done` taking a checkpoint every few steps. Its stall per checkpoint is the
      time inside `step_done` on the checkpoint's step plus the next step's wait at the copy fence (the
      session's optimizer step pre-hook), what (a) counts for the bare Checkpointer: the session does
      more at a checkpoint step (the metrics sidecar, every part's capture, the EMA copied at the
      boundary), and the recipe loop runs on the same session. Against torch.save + fsync +
      upload_file of the same state, as (a): `session_stall_ratio`, goal >= 50 (bench/session_case.py).

Then, against an endpoint that behaves like S3 (bench/capped_s3.py: each connection capped at --cap-mb-s,
20 MB/s by default, each request delayed --latency-ms; sizes kept, large bodies discarded), in its own
process:
  (h) capped: (d) again, 64 MB (8 parts of 8 MiB at concurrency 8: the default part size and
      concurrency), against a single-stream put_object / get_object through the same endpoint:
      `upload_ratio_capped`, `download_ratio_capped`, goal >= 3, each beside `ideal_ratio_capped`, what
      the cap alone allows (bench/capped_s3.py ideal_ratio). Then a notice's emergency save of the
      largest state (1 GB; 50 MB with --quick) to that endpoint, timed to durable:
      `durable_after_notice_capped_s`, beside `ideal_upload_capped_s` (its bytes over 8 capped streams).

Prints human-readable lines; the last line is one JSON object holding the worst case of each ratio.
The full results also go to bench/out/checkpoint.json. Run from the repo root:
    .venv/bin/python bench/checkpoint.py [--quick] [--threads N] [--only single|fsdp|session|capped]
Exit codes: 0 measured (a missed goal is a verdict in the output, not an error); 1 the FSDP ranks
failed (their last lines are printed); 2 bad arguments.
"""

from __future__ import annotations

import os

from spotrun.tasks.providers.local import OMP_WAIT  # imports no torch

# OpenMP threads that sleep while they wait, as the local provider runs every trainer: set before torch
# loads OpenMP. With GOMP's default (threads spin at each barrier before they sleep), any other runnable
# process on a 2-core machine stretched the charlm step ~10x (300 ms -> 3.7 s beside a nice-19 busy
# loop; 1.6x with PASSIVE, measured), and (b) measured that spinning instead of the checkpoint.
# OMP_WAIT_POLICY=ACTIVE in the environment measures the other case.
os.environ.update({**OMP_WAIT, **os.environ})  # defaults: what the environment sets wins

import argparse
import cProfile
import gc
import json
import logging
import pstats
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import boto3
import torch
from safetensors.torch import load_file

from spotrun.server import free_port
from spotrun.trainer import recipes
from spotrun.trainer.checkpoint.format import MODEL_FILE, sha256_file
from spotrun.trainer.checkpoint.signing import KEY_ENV, OLD_KEYS_ENV
from spotrun.trainer.checkpoint.state import capture_rng, update_only_views
from spotrun.trainer.checkpoint.validate import Expectation, read_manifest, validate_dir
from spotrun.trainer.recipes.charlm import state_bytes
from spotrun.trainer.saving.checkpointer import Checkpointer
from spotrun.trainer.spec.job import JobSpec
from spotrun.trainer.storage import LocalStorage, Storage
from spotrun.trainer.storage.options import S3Options
from spotrun.trainer.storage.s3 import S3Storage, make_s3_client

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # bench/ is scripts, not a package
from bench.capped_s3 import DEFAULT_LATENCY_MS, DEFAULT_MB_S, ideal_ratio
from bench.session_case import measure_session, report_session

MB = 1024 * 1024
ROOT = Path(__file__).resolve().parent.parent
BUCKET = "spotrun-bench"
CHECKPOINT_EVERY_S = 60.0
SIGNED_REPS = {"quick": 3, "full": 5}  # (f): interleaved runs with and without the key, each
OUT = Path(__file__).resolve().parent / "out" / "checkpoint.json"


@dataclass(frozen=True)
class Size:
    label: str
    args: dict[str, Any]  # charlm args
    batch_size: int  # small batches: keep 1 GB steps near a second on 2 cores
    stall_reps: int  # measured async saves after the first (which allocates the buffers)


FULL = [
    Size("100MB", {"d_model": 384, "n_layers": 5, "seq_len": 64, "dropout": 0.0}, 4, 5),
    Size("1GB", {"d_model": 1024, "n_layers": 7, "seq_len": 64, "dropout": 0.0}, 1, 2),
]
QUICK = [
    Size("10MB", {"d_model": 128, "n_layers": 4, "seq_len": 64, "dropout": 0.0}, 4, 3),
    Size("50MB", {"d_model": 256, "n_layers": 5, "seq_len": 64, "dropout": 0.0}, 4, 3),
]

# (e): charlm args for the FSDP case (~109 MB and ~23 MB of model + AdamW state), measured repetitions
FSDP_FULL = {"d_model": 384, "n_layers": 5, "reps": 5}
FSDP_QUICK = {"d_model": 192, "n_layers": 4, "reps": 3}
FSDP_RANKS = 2
FSDP_TIMEOUT_S = 900


def say(msg: str) -> None:
    print(msg, flush=True)


# ---------------------------------------------------------------- training harness


@dataclass
class Trainee:
    """A charlm model training on cycled batches, with the state the loop would checkpoint."""

    spec: JobSpec
    parts: recipes.Parts
    batches: list[Any]
    step: int = 0

    @classmethod
    def build(cls, size: Size) -> Trainee:
        spec = JobSpec(
            name=f"bench-{size.label}",
            recipe="charlm",
            args=size.args,
            total_steps=100_000,
            batch_size=size.batch_size,
            threads=torch.get_num_threads(),
        )
        torch.manual_seed(0)
        ctx = recipes.RecipeContext(spec.seed, spec.total_steps, spec.batch_size, torch.device("cpu"))
        parts = recipes.build("charlm", size.args, ctx)
        n = size.batch_size
        batches = [
            torch.utils.data.default_collate([parts.dataset[b * n + i] for i in range(n)]) for b in range(8)
        ]
        return cls(spec, parts, batches)

    def train_step(self, ckpt: Checkpointer | None = None) -> float:
        """One step, as trainer/session/loop.py's: a save in flight may still be copying the parameters and
        optimizer state during its forward and backward, and its update waits for that (`fence`).
        Returns the seconds waited there."""
        p = self.parts
        loss = p.loss_fn(p.model, self.batches[self.step % len(self.batches)])
        p.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(p.model.parameters(), 1.0)
        waited = ckpt.fence() if ckpt is not None else 0.0
        p.optimizer.step()
        assert p.scheduler is not None  # charlm schedules its rate
        p.scheduler.step()
        self.step += 1
        return waited

    def checkpointer(self, storage: Storage, cache: Path, **kw: Any) -> Checkpointer:
        """A Checkpointer as trainer/session/loop.py makes one: it copies what only the update
        changes later."""
        p = self.parts
        return Checkpointer(
            storage, cache, keep=2, update_only=lambda: update_only_views(p.model, p.optimizer), **kw
        )

    def capture(self) -> dict[str, Any]:
        """The state as trainer/session/loop.py captures it."""
        p = self.parts
        assert p.scheduler is not None
        meta = {
            "step": self.step,
            "position": {"epoch": 0, "batch": self.step},
            "best_metric": 0.0,
            "spec": self.spec.model_dump(mode="json"),
            "spec_hash": self.spec.spec_hash(),
            "shape_hash": self.spec.shape_hash(),
            "torch_version": str(torch.__version__),
            "threads": torch.get_num_threads(),
            "rank": 0,
            "world_size": 1,
            "device": "cpu",
        }
        return {
            "model": p.model.state_dict(),
            "optimizer": p.optimizer.state_dict(),
            "scheduler": p.scheduler.state_dict(),
            "scaler": None,
            "rng": capture_rng(torch.device("cpu")),
            "trainer": meta,
        }

    def manifest_base(self) -> dict[str, Any]:
        s = self.spec
        return {"step": self.step, "spec_hash": s.spec_hash(), "shape_hash": s.shape_hash(), "world_size": 1}

    def save(self, ckpt: Checkpointer, wait: bool = False) -> float:
        """Capture and hand to the checkpointer; returns the seconds the loop was blocked."""
        t0 = time.perf_counter()
        ckpt.save(self.capture(), self.manifest_base(), wait=wait)
        return time.perf_counter() - t0


def actual_state_bytes(t: Trainee) -> int:
    model = sum(v.numel() * v.element_size() for v in t.parts.model.state_dict().values())
    opt = t.parts.optimizer.state.values()
    return model + sum(v.numel() * v.element_size() for s in opt for v in s.values() if v.dim() > 0)


# ---------------------------------------------------------------- (a) stall


def measure_stall(t: Trainee, s3: S3, prefix: str, *, work: Path, reps: int) -> dict[str, Any]:
    ckpt = t.checkpointer(s3.storage(prefix), work / "cache-a")
    t.train_step()
    t.save(ckpt)  # the first save allocates the snapshot buffers
    ckpt.wait()
    stalls, fences = [], []
    for _ in range(reps):
        t.train_step()
        stall = t.save(ckpt)
        fences.append(t.train_step(ckpt))  # the next step's update waits for the rest of the copy
        stalls.append(stall + fences[-1])
        ckpt.wait()
    bg = ckpt.history[-1]
    # A notice at a step boundary, nothing in flight: the emergency save blocks until durable
    # (snapshot, write, upload, confirm, `latest`), as trainer/session/loop.py runs it.
    t.train_step()
    notice_s = t.save(ckpt, wait=True)
    writer = "process" if ckpt.uses_process else "thread"
    ckpt.close()
    sync = sync_save_upload(t, s3.plain, work / "sync.pt", f"{prefix}/sync.pt")
    async_s = statistics.median(stalls)
    return {
        "async_stall_s": async_s,
        "async_stalls_s": stalls,
        "fence_waits_s": fences,
        "snapshot_s": bg.snapshot_s,
        "background_s": {"write": bg.write_s, "upload": bg.upload_s, "verify": bg.verify_s},
        "sync_stall_s": sync,
        "stall_ratio": sync / async_s,
        "writer": writer,
        "durable_after_notice_s": notice_s,
        "notice_ratio": notice_s / sync,
    }


def sync_save_upload(t: Trainee, client: Any, path: Path, key: str) -> float:
    """The plain way: torch.save the whole state, fsync, boto3 upload_file; all of it blocks."""
    t0 = time.perf_counter()
    with open(path, "wb") as f:
        torch.save(t.capture(), f)
        f.flush()
        os.fsync(f.fileno())
    client.upload_file(str(path), BUCKET, key)
    elapsed = time.perf_counter() - t0
    path.unlink()
    return elapsed


# ---------------------------------------------------------------- (b) overhead


@dataclass
class Run:
    wall_s: float = 0.0
    steps_s: list[float] = field(default_factory=list)  # steps with no checkpoint work beside them
    overlapped_s: list[float] = field(default_factory=list)  # steps that began while a save was running
    stall_s: float = 0.0  # the loop blocked in Checkpointer.save
    tail_s: float = 0.0  # waiting at the end for a background save still running
    saved_at: float = 0.0  # perf_counter() when the checkpoint's save was called

    def extra_s(self) -> float:
        """Loop time the checkpoint cost, against this run's own undisturbed steps: the noise of
        the other work on the machine then enters only through the few overlapped steps."""
        base = statistics.median(self.steps_s)
        return self.stall_s + self.tail_s + sum(s - base for s in self.overlapped_s)


def run_steps(
    t: Trainee, n: int, ckpt: Checkpointer | None = None, *, at: int = 4, limit_s: float = CHECKPOINT_EVERY_S
) -> Run:
    """At least n training steps. With `ckpt`: one async checkpoint before step `at`, and steps go
    on until it is durable (the writer runs at low priority and may need many steps), for at most
    `limit_s`: a save not durable by the next one's time would block it, so a save still running
    then is waited for, and that wait counts in full."""
    w0 = time.perf_counter()
    run = Run()
    i = 0
    while i < n or (ckpt is not None and ckpt.in_flight and time.perf_counter() - w0 < limit_s):
        if ckpt is not None and i == at:
            run.saved_at = time.perf_counter()
            run.stall_s = t.save(ckpt)
        overlapped = ckpt is not None and ckpt.in_flight
        s0 = time.perf_counter()
        t.train_step(ckpt)  # its wait at the fence, if any, is in the step's time
        (run.overlapped_s if overlapped else run.steps_s).append(time.perf_counter() - s0)
        i += 1
    if ckpt is not None:
        s0 = time.perf_counter()
        ckpt.wait()
        run.tail_s = time.perf_counter() - s0
    run.wall_s = time.perf_counter() - w0
    return run


def measure_overhead(t: Trainee, work: Path, budget_s: float, writer: str) -> dict[str, Any]:
    remote = LocalStorage(work / f"remote-b-{writer}")
    ckpt = t.checkpointer(remote, work / f"cache-b-{writer}", writer=writer)
    try:
        return _measure_overhead(t, ckpt, remote, budget_s)
    finally:
        ckpt.close()


def _measure_overhead(
    t: Trainee, ckpt: Checkpointer, remote: LocalStorage, budget_s: float
) -> dict[str, Any]:
    t.train_step()
    t.save(ckpt)  # starts the writer (a process imports torch) and allocates the buffers
    ckpt.wait()
    t.save(ckpt, wait=True)  # a synchronous save alone, for comparison
    sync = ckpt.history[-1]
    step_s = statistics.median(run_steps(t, 3).steps_s)
    n = 12  # 4 undisturbed steps, the save, then steps until it is durable and at least to 12
    pairs = max(2, min(5, int(budget_s / (2 * max(n * step_s, 2 * sync.total_s)))))
    base, with_ckpt = [], []
    for _ in range(pairs):  # interleaved, so a change in machine load hits both alike
        with_ckpt.append(run_steps(t, n, ckpt))
        base.append(run_steps(t, len(with_ckpt[-1].steps_s) + len(with_ckpt[-1].overlapped_s)))
    extra = [r.extra_s() for r in with_ckpt]
    paired = [w.wall_s - b.wall_s for b, w in zip(base, with_ckpt, strict=True)]
    base_step = statistics.median(s for r in base for s in r.steps_s)
    overlapped = [s for r in with_ckpt for s in r.overlapped_s]
    extra_s = statistics.median(extra)
    return {
        "remote_dir": str(remote.root),
        "sync_save_s": sync.total_s,
        "pairs": pairs,
        "steps_per_run": [len(r.steps_s) + len(r.overlapped_s) for r in with_ckpt],
        "sync_phases_s": {"write": sync.write_s, "upload": sync.upload_s, "verify": sync.verify_s},
        "base_step_s": base_step,
        "extra_s_each": extra,
        "extra_s": extra_s,
        "paired_diff_s_each": paired,
        "stall_s": statistics.median(r.stall_s for r in with_ckpt),
        "overlapped_steps": statistics.median(len(r.overlapped_s) for r in with_ckpt),
        "slowdown_during_save": statistics.median(overlapped) / base_step if overlapped else None,
        "tail_wait_s": max(r.tail_s for r in with_ckpt),
        "overhead_pct": 100 * max(extra_s, 0.0) / CHECKPOINT_EVERY_S,
    }


# ---------------------------------------------------------------- (c) validation


def plain_load(d: Path) -> None:
    """What loading needs without validation: safetensors for the weights, torch.load for the rest."""
    load_file(str(d / MODEL_FILE))
    for p in sorted(d.glob("*.pt")):
        torch.load(p, map_location="cpu", weights_only=True)


def resume_load(t: Trainee, d: Path) -> None:
    """Plain load plus load_state_dict, which touches every weight page (load_file only maps them)."""
    t.parts.model.load_state_dict(load_file(str(d / MODEL_FILE)))
    t.parts.optimizer.load_state_dict(torch.load(d / "optimizer.pt", weights_only=True)["state"])
    for p in sorted(d.glob("*.pt")):
        if p.name != "optimizer.pt":
            torch.load(p, map_location="cpu", weights_only=True)


def best_of(fn: Callable[[], Any], reps: int) -> float:
    """Fastest of `reps` timed calls: the figure least disturbed by other work on the machine."""
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def hot_spots(fn: Callable[[], Any], top: int = 3) -> list[tuple[str, float]]:
    """The functions where `fn` spends its own time (main thread), as (name, share of the total)."""
    prof = cProfile.Profile()
    prof.runcall(fn)
    stats = pstats.Stats(prof).stats  # type: ignore[attr-defined]
    total = sum(v[2] for v in stats.values()) or 1.0
    ranked = sorted(stats.items(), key=lambda kv: kv[1][2], reverse=True)[:top]
    return [(f"{Path(k[0]).name}:{k[2]}" if k[0] != "~" else k[2], v[2] / total) for k, v in ranked]


def measure_validate(t: Trainee, remote_dir: Path, reps: int = 3) -> dict[str, Any]:
    d = max(remote_dir.glob("step_*"))
    expect = Expectation.from_parts(t.parts.model, t.parts.optimizer, t.spec.shape_hash())
    problems = validate_dir(d, expect)  # also warms the page cache for both
    if problems:
        raise SystemExit(f"benchmark checkpoint {d} failed validation: {[str(p) for p in problems]}")
    plain_load(d)
    files = sorted(p for p in d.iterdir() if p.is_file())
    validate_s = best_of(lambda: validate_dir(d, expect), reps)
    plain_s = best_of(lambda: plain_load(d), reps)
    resume_s = best_of(lambda: resume_load(t, d), reps)
    sha_s = best_of(lambda: [sha256_file(p) for p in files], reps)
    nbytes = sum(p.stat().st_size for p in files)
    return {
        "bytes": nbytes,
        "validate_s": validate_s,
        "plain_load_s": plain_s,
        "resume_load_s": resume_s,
        "sha256_s": sha_s,
        "sha256_mb_s": nbytes / MB / sha_s,
        "validate_ratio": validate_s / plain_s,
        "hot_spots": hot_spots(lambda: validate_dir(d, expect)),
    }


# ---------------------------------------------------------------- (f) signing


@contextmanager
def manifest_key(key: str | None) -> Iterator[None]:
    """`SPOTRUN_MANIFEST_KEY` set to `key` (None: unset) for what runs inside. A writer process keeps
    the environment it was started in, so a checkpointer's first save decides whether it signs."""
    before = os.environ.pop(KEY_ENV, None)
    if key is not None:
        os.environ[KEY_ENV] = key
    try:
        yield
    finally:
        os.environ.pop(KEY_ENV, None)
        if before is not None:
            os.environ[KEY_ENV] = before


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU time of a process (all its threads) so far; None where /proc has no answer."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime


@dataclass
class Side:
    """One side of (f): a writer-process checkpointer started with or without the key."""

    key: str | None
    ckpt: Checkpointer
    durable_at: list[float] = field(default_factory=list)
    extra_s: list[float] = field(default_factory=list)
    durable_s: list[float] = field(default_factory=list)
    writer_cpu_s: list[float] = field(default_factory=list)

    def run(self, t: Trainee, n: int) -> None:
        pid = self.ckpt._proc.proc.pid if self.ckpt._proc is not None else None
        cpu0 = cpu_seconds(pid) if pid else None
        with manifest_key(self.key):
            r = run_steps(t, n, self.ckpt)
        cpu1 = cpu_seconds(pid) if pid else None
        self.extra_s.append(r.extra_s())
        self.durable_s.append(self.durable_at[-1] - r.saved_at)
        if cpu0 is not None and cpu1 is not None:
            self.writer_cpu_s.append(cpu1 - cpu0)

    def summary(self) -> dict[str, Any]:
        cpu = statistics.median(self.writer_cpu_s) if self.writer_cpu_s else None
        extra = statistics.median(self.extra_s)
        return {
            "extra_s": extra,
            "extra_s_each": self.extra_s,
            "writer_cpu_s": cpu,
            "durable_s": statistics.median(self.durable_s),
            "durable_s_each": self.durable_s,
            "overhead_pct": 100 * max(extra, 0.0) / CHECKPOINT_EVERY_S,
        }


def measure_signed(t: Trainee, work: Path, reps: int) -> dict[str, Any]:
    """(f): one async checkpoint's loop overhead and time to durable with the key vs without, then
    validation with vs without it (see the module's docstring)."""
    sides: dict[str, Side] = {}
    try:
        for name, key in (("plain", None), ("keyed", os.urandom(16).hex())):
            stamps: list[float] = []
            with manifest_key(key):
                ckpt = t.checkpointer(
                    LocalStorage(work / f"remote-f-{name}"),
                    work / f"cache-f-{name}",
                    writer="process",
                    on_durable=lambda _step, _sidecars, s=stamps: s.append(time.perf_counter()),
                )
                sides[name] = Side(key, ckpt, stamps)
                t.train_step()
                t.save(ckpt)  # starts its writer process, in this environment, and allocates the buffers
                ckpt.wait()
        n = 12  # as in (b)
        for i in range(reps):  # interleaved, each side first in turn, so load changes hit both alike
            for name in ("plain", "keyed") if i % 2 == 0 else ("keyed", "plain"):
                sides[name].run(t, n)
        plain, keyed = sides["plain"].summary(), sides["keyed"].summary()
        validate = measure_signed_validate(t, work, sides)
    finally:
        for side in sides.values():
            side.ckpt.close()
    rmtree(*(work / f"{kind}-f-{name}" for kind in ("remote", "cache") for name in sides))
    return {
        "reps": reps,
        "plain": plain,
        "keyed": keyed,
        **validate,
        "signed_overhead_pct": pct_more(keyed["extra_s"], plain["extra_s"]),
        "signed_durable_pct": pct_more(keyed["durable_s"], plain["durable_s"]),
        "signed_writer_cpu_pct": pct_more(keyed["writer_cpu_s"], plain["writer_cpu_s"])
        if keyed["writer_cpu_s"] is not None and plain["writer_cpu_s"] is not None
        else None,
    }


def pct_more(x: float, base: float) -> float | None:
    return 100 * (x - base) / base if base > 0 else None


def measure_signed_validate(t: Trainee, work: Path, sides: dict[str, Side], reps: int = 3) -> dict[str, Any]:
    """validate_dir of each side's newest checkpoint in its own environment, fastest of `reps`
    interleaved; the keyed one must verify under the key, or this would time the xxh3 path twice."""
    expect = Expectation.from_parts(t.parts.model, t.parts.optimizer, t.spec.shape_hash())
    dirs = {name: max((work / f"remote-f-{name}").glob("step_*")) for name in sides}
    for name, side in sides.items():
        with manifest_key(side.key):
            manifest, problems = read_manifest(dirs[name])
            problems += validate_dir(dirs[name], expect)  # also warms the page cache
            signed = manifest is not None and manifest.verdict().key is not None
        if problems or signed != (side.key is not None):
            why = [str(p) for p in problems] or [f"signed: {signed}"]
            raise SystemExit(f"(f) {name} checkpoint {dirs[name]} is not what (f) measures: {why}")
    times: dict[str, list[float]] = {name: [] for name in (*sides, "load")}
    for _ in range(reps):
        for name, side in sides.items():
            with manifest_key(side.key):
                times[name].append(best_of(partial(validate_dir, dirs[name], expect), 1))
        times["load"].append(best_of(partial(plain_load, dirs["keyed"]), 1))
    best = {name: min(ts) for name, ts in times.items()}
    nbytes = sum(p.stat().st_size for p in dirs["keyed"].iterdir() if p.is_file())
    return {
        "validate_s": best,
        "bytes": nbytes,
        "signed_validate_ratio": best["keyed"] / best["plain"],
        "keyed_vs_plain_load": best["keyed"] / best["load"],  # (c)'s ratio, with the key
    }


def report_signed(label: str, f: dict[str, Any]) -> None:
    p, k = f["plain"], f["keyed"]
    over, durable, ratio = f["signed_overhead_pct"], f["signed_durable_pct"], f["signed_validate_ratio"]

    def each(xs: list[float]) -> str:
        return ", ".join(f"{x:.2f}" for x in xs)

    say(
        f"[{label}] (f) with {KEY_ENV} (keyed BLAKE3 digests, signed manifest) vs without, writer process, "
        f"median of {f['reps']} interleaved runs each:"
    )
    more = f"{over:+.1f}% {verdict(over <= 5)} (<= 5%)" if over is not None else "no unkeyed cost to compare"
    say(
        f"[{label}]     loop overhead of one async checkpoint {k['extra_s']:.2f}s "
        f"({each(k['extra_s_each'])}) vs {p['extra_s']:.2f}s ({each(p['extra_s_each'])}) -> {more}"
    )
    cpu = (
        f"; the writer's CPU per save {k['writer_cpu_s']:.2f}s vs {p['writer_cpu_s']:.2f}s "
        f"({f['signed_writer_cpu_pct']:+.1f}%)"
        if f["signed_writer_cpu_pct"] is not None
        else ""
    )
    say(
        f"[{label}]     save -> durable {k['durable_s']:.2f}s vs {p['durable_s']:.2f}s"
        + (f" ({durable:+.1f}%)" if durable is not None else "")
        + cpu
    )
    say(
        f"[{label}]     amortized over one checkpoint per {CHECKPOINT_EVERY_S:.0f}s of training: "
        f"{k['overhead_pct']:.2f}% with the key vs {p['overhead_pct']:.2f}% without"
    )
    v = f["validate_s"]
    say(
        f"[{label}]     validate_dir {f['bytes'] / 1e6:.0f} MB with the key (keyed digests) "
        f"{v['keyed']:.3f}s vs without (xxh3) {v['plain']:.3f}s -> {ratio:.2f}x; fastest of 3, "
        "page cache warm"
    )
    load = f["keyed_vs_plain_load"]
    say(
        f"[{label}]     with the key vs a plain load of the same files {v['load']:.3f}s: {load:.2f}x "
        f"{verdict(load <= 1.5)} (<= 1.5x, as (c))"
    )


# ---------------------------------------------------------------- (d) transfer


def measure_transfer(s3: S3, prefix: str, work: Path, *, mb: int, reps: int = 3) -> dict[str, Any]:
    storage, plain = s3.storage(prefix), s3.plain
    src, dst = work / "blob", work / "blob.down"
    src.write_bytes(os.urandom(mb * MB))
    key, plain_key = "spotrun.blob", f"{prefix}/plain.blob"
    ops = {
        "put": lambda: storage.put(key, src),
        "put_object": lambda: plain_put(plain, src, plain_key),
        "get": lambda: storage.get(key, dst),
        "get_object": lambda: plain_get(plain, plain_key, dst),
    }
    times: dict[str, list[float]] = {k: [] for k in ops}
    for _ in range(reps):  # interleaved, so a change in machine load hits both alike
        for name, op in ops.items():
            times[name].append(best_of(op, 1))
    delete_prefix(plain, prefix)
    rate = {k: mb / min(v) for k, v in times.items()}
    return {
        "object_mb": mb,
        "mb_s": rate,
        "seconds": times,
        "upload_ratio": rate["put"] / rate["put_object"],
        "download_ratio": rate["get"] / rate["get_object"],
    }


def plain_put(client: Any, src: Path, key: str) -> None:
    with open(src, "rb") as f:
        client.put_object(Bucket=BUCKET, Key=key, Body=f)


def plain_get(client: Any, key: str, dst: Path) -> None:
    """One GET streamed to a file, fsynced like S3Storage.get does, so both land equally durable."""
    body = client.get_object(Bucket=BUCKET, Key=key)["Body"]
    with open(dst, "wb") as f:
        for chunk in body.iter_chunks(MB):
            f.write(chunk)
        f.flush()
        os.fsync(f.fileno())


# ---------------------------------------------------------------- (h) capped


CAPPED_MB = 64  # 8 parts of the default 8 MiB: one wave of the default 8 streams


@contextmanager
def capped_endpoint(mb_s: float, latency_ms: float) -> Iterator[str]:
    """bench/capped_s3.py in its own process (its threads off this one's GIL); yields its URL."""
    cmd = [sys.executable, str(ROOT / "bench" / "capped_s3.py"), "--mb-s", str(mb_s)]
    server = subprocess.Popen([*cmd, "--latency-ms", str(latency_ms)], stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout is not None
        yield server.stdout.readline().strip()
    finally:
        server.terminate()
        server.wait(timeout=10)


def measure_capped(s3: S3, work: Path, *, size: Size, mb_s: float, latency_ms: float) -> dict[str, Any]:
    """(h): the transfer ratios through the capped endpoint, then a notice's save of `size` to it."""
    opts = s3.opts
    d = measure_transfer(s3, "capped", work, mb=CAPPED_MB, reps=2)
    part, conc = opts.multipart_chunk_mb * MB, opts.max_concurrency
    t = Trainee.build(size)
    t.train_step()
    ckpt = t.checkpointer(s3.storage("capped-notice"), work / "cache-h")
    t.train_step()
    notice_s = t.save(ckpt, wait=True)
    ckpt.close()
    rmtree(work / "cache-h")
    state = actual_state_bytes(t)
    return {
        "cap_mb_s": mb_s,
        "latency_ms": latency_ms,
        "transfer": d,
        "upload_ratio_capped": d["upload_ratio"],
        "download_ratio_capped": d["download_ratio"],
        "ideal_ratio_capped": ideal_ratio(CAPPED_MB * MB, part, conc),
        "state_bytes": state,
        "durable_after_notice_capped_s": notice_s,
        "ideal_upload_capped_s": state / (min(conc, -(-state // part)) * mb_s * MB),
    }


def report_capped(h: dict[str, Any]) -> None:
    r, ideal = h["transfer"]["mb_s"], h["ideal_ratio_capped"]
    up, down = h["upload_ratio_capped"], h["download_ratio_capped"]
    where = f"{h['cap_mb_s']:.0f} MB/s per connection, +{h['latency_ms']:.0f} ms a request"
    say(
        f"(h) {CAPPED_MB} MB through a capped endpoint ({where}): S3Storage.put {r['put']:.0f} MB/s vs "
        f"put_object {r['put_object']:.0f} MB/s -> {up:.2f}x {verdict(up >= 3)} (>= 3; ideal {ideal:.1f}x)"
    )
    say(
        f"(h) S3Storage.get {r['get']:.0f} MB/s vs get_object {r['get_object']:.0f} MB/s -> {down:.2f}x "
        f"{verdict(down >= 3)} (>= 3; ideal {ideal:.1f}x)"
    )
    say(
        f"(h) notice save of {h['state_bytes'] / 1e9:.2f} GB durable in "
        f"{h['durable_after_notice_capped_s']:.1f}s (its upload alone at the cap, ideally: "
        f"{h['ideal_upload_capped_s']:.1f}s)"
    )


# ---------------------------------------------------------------- (e) fsdp


def measure_fsdp(quick: bool, work: Path) -> dict[str, Any]:
    """Run bench/checkpoint_fsdp.py on 2 ranks under torchrun and read what its rank 0 wrote.
    One intra-op thread a rank (what torchrun would set): 2 ranks on a 2-core machine."""
    size = FSDP_QUICK if quick else FSDP_FULL
    out, log_path = work / "fsdp.json", work / "fsdp.log"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        str(FSDP_RANKS),
        str(ROOT / "bench" / "checkpoint_fsdp.py"),
        "--out",
        str(out),
        "--dir",
        str(work / "fsdp"),
        "--d-model",
        str(size["d_model"]),
        "--n-layers",
        str(size["n_layers"]),
        "--reps",
        str(size["reps"]),
    ]
    env = os.environ | {"OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    t0 = time.perf_counter()
    with open(log_path, "wb") as log_file:
        try:
            rc = subprocess.run(
                cmd, cwd=ROOT, env=env, stdout=log_file, stderr=subprocess.STDOUT, timeout=FSDP_TIMEOUT_S
            ).returncode
        except subprocess.TimeoutExpired:
            rc = None
    if rc != 0 or not out.is_file():
        tail = log_path.read_text(errors="replace").splitlines()[-15:]
        why = f"timed out after {FSDP_TIMEOUT_S}s" if rc is None else f"exit code {rc}"
        say("\n".join(tail))
        raise SystemExit(f"(e) the FSDP ranks failed ({why}); their last lines are above")
    result: dict[str, Any] = json.loads(out.read_text())
    result["wall_s"] = time.perf_counter() - t0
    rmtree(work / "fsdp")
    return result


def report_fsdp(e: dict[str, Any]) -> None:
    med, best, prof = e["median"], e["best"], e["profile"]
    stall, durable = e["stall_ratio"], e["durable_ratio"]
    say(
        f"(e) FSDP2, {e['world_size']} gloo ranks, charlm {e['args']}: state {e['state_bytes'] / 1e6:.0f} MB "
        f"(estimate {e['estimate_bytes'] / 1e6:.0f} MB), checkpoint {e['checkpoint_bytes'] / 1e6:.0f} MB, "
        f"gathered file {e['baseline_file_bytes'] / 1e6:.0f} MB; median of {e['reps']} interleaved runs, "
        f"slowest rank each, in {e['wall_s']:.0f}s"
    )
    say(
        f"(e) stall: spotrun {med['stall'] * 1e3:.0f} ms (fastest {best['stall'] * 1e3:.0f}) vs rank-0 "
        f"gathered torch.save {med['base_total']:.2f}s (fastest {best['base_total']:.2f}) -> {stall:.1f}x "
        f"{verdict(stall >= 50)} (>= 50)"
    )
    say(
        f"(e)     the stall: the save call {med['save_call'] * 1e3:.0f} ms, the next step's wait before its "
        f"update {med['fence'] * 1e3:.0f} ms (the copy runs beside its forward and backward); that step took "
        f"{med['step_slowdown_s'] * 1e3:+.0f} ms against a plain one, the background write beside it"
    )
    say(
        f"(e) time-to-durable: spotrun {med['durable']:.2f}s (fastest {best['durable']:.2f}) vs "
        f"{med['base_total']:.2f}s -> {durable:.2f}x {verdict(durable <= 0.7)} (<= 0.7)"
    )
    say(
        f"(e)     spotrun phases: stage {med['stage'] * 1e3:.0f} ms, DCP write + .pt files + hashing "
        f"{med['write_hash']:.2f}s, copy into the storage dir {med['upload']:.2f}s, manifest + read-back + "
        f"latest {med['commit']:.2f}s; durable verdict on every rank at {med['verdict']:.2f}s, the rest of "
        f"the wait is retention and local pruning"
    )
    say(f"(e)     the same save with wait=True (all at normal priority): {med['sync_durable']:.2f}s")
    say(
        f"(e)     baseline phases: gather to rank 0 {med['base_gather']:.2f}s, torch.save + fsync "
        f"{med['base_save']:.2f}s"
    )
    say(
        f"(e)     each alone, slowest rank: get_state_dict {prof['get_state_dict'] * 1e3:.0f} ms, dcp.save "
        f"{prof['dcp_save']:.2f}s, hash the {prof['shard_mb']:.0f} MB shard {prof['hash_shard']:.3f}s, "
        f"copy it durably {prof['copy_durable_shard']:.2f}s, read it back {prof['read_back_shard']:.3f}s"
    )


# ---------------------------------------------------------------- driver


@dataclass
class S3:
    """The moto endpoint, reached by spotrun's S3Storage and by a plain boto3 client. Credentials are
    explicit fakes (moto accepts any), so a developer's real ones are never read or sent."""

    opts: S3Options
    session: boto3.session.Session
    plain: Any

    @classmethod
    def connect(cls, endpoint: str) -> S3:
        # the writer process (states >= 64 MB) opens S3 again from the environment, as on a worker:
        # the same fakes there, and never a developer's profile or session token
        for k in ("AWS_PROFILE", "AWS_SESSION_TOKEN"):
            os.environ.pop(k, None)
        os.environ.update(AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench")
        os.environ["AWS_DEFAULT_REGION"] = "us-east-1"
        session = boto3.session.Session(
            aws_access_key_id="bench", aws_secret_access_key="bench", region_name="us-east-1"
        )
        plain = session.client("s3", endpoint_url=endpoint)
        plain.create_bucket(Bucket=BUCKET)
        return cls(S3Options(endpoint_url=endpoint, region="us-east-1"), session, plain)

    def storage(self, prefix: str) -> S3Storage:
        return S3Storage(make_s3_client(self.opts, session=self.session), BUCKET, prefix, self.opts)


@contextmanager
def moto_endpoint() -> Iterator[str]:
    """A moto S3 server in its own process on 127.0.0.1; yields its endpoint URL. Not in this process:
    there the mock's request handling shares the client's GIL, and parallel parts measured the mock
    (8 MiB parts: 0.85x a single PUT in-process, 1.19x against a separate server, at 100 MB)."""
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    endpoint = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(f"{endpoint}/moto-api/", timeout=2).close()
                break
            except OSError:
                if server.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit(f"moto server did not start on port {port}") from None
                time.sleep(0.1)
        yield endpoint
    finally:
        server.terminate()
        server.wait(timeout=10)


def bench_size(size: Size, s3: S3, work: Path, *, budget_s: float, signed_reps: int = 0) -> dict[str, Any]:
    """(a)-(c) for one size, and (f) with `signed_reps` runs a side (0: not for this size)."""
    t0 = time.perf_counter()
    t = Trainee.build(size)
    t.train_step()
    est, actual = state_bytes(size.args), actual_state_bytes(t)
    say(
        f"[{size.label}] charlm {size.args} batch {size.batch_size}: state {actual / 1e6:.0f} MB "
        f"(estimate {est / 1e6:.0f} MB), built in {time.perf_counter() - t0:.1f}s"
    )
    # the thread writer first, as the baseline: what the same save costs the loop from a thread
    bt = measure_overhead(t, work, budget_s, "thread")
    report_overhead(f"{size.label} thread", bt)
    rmtree(Path(bt.pop("remote_dir")), work / "cache-b-thread")
    b = measure_overhead(t, work, budget_s, "process")
    b["thread"] = bt
    b["process_vs_thread"] = b["extra_s"] / bt["extra_s"] if bt["extra_s"] > 0 else None
    report_overhead(f"{size.label} process", b)
    say(
        f"[{size.label}]     writer process vs thread: the loop pays {b['extra_s']:.2f}s vs "
        f"{bt['extra_s']:.2f}s per checkpoint"
    )
    c = measure_validate(t, Path(b.pop("remote_dir")))
    report_validate(size.label, c)
    rmtree(work / "remote-b-process", work / "cache-b-process")
    f = measure_signed(t, work, signed_reps) if signed_reps else None
    if f is not None:
        report_signed(size.label, f)
    a = measure_stall(t, s3, f"ckpt-{size.label}", work=work, reps=size.stall_reps)
    report_stall(size.label, a)
    rmtree(work / "cache-a")
    delete_prefix(s3.plain, f"ckpt-{size.label}")  # moto holds objects in memory and temp files
    say(f"[{size.label}] done in {time.perf_counter() - t0:.0f}s")
    out = {"state_bytes": actual, "estimate_bytes": est, "stall": a, "overhead": b, "validate": c}
    return out | ({"signed": f} if f is not None else {})


def delete_prefix(client: Any, prefix: str) -> None:
    keys = [
        {"Key": o["Key"]} for o in client.list_objects_v2(Bucket=BUCKET, Prefix=prefix).get("Contents", [])
    ]
    if keys:
        client.delete_objects(Bucket=BUCKET, Delete={"Objects": keys})


def rmtree(*dirs: Path) -> None:
    for d in dirs:
        shutil.rmtree(d, ignore_errors=True)


def report_stall(label: str, a: dict[str, Any]) -> None:
    ratio, bg = a["stall_ratio"], a["background_s"]
    say(
        f"[{label}] (a) stall per checkpoint: spotrun async {a['async_stall_s'] * 1e3:.0f} ms "
        f"(median of {len(a['async_stalls_s'])}; snapshot {a['snapshot_s'] * 1e3:.0f} ms) vs "
        f"torch.save+fsync+upload_file {a['sync_stall_s']:.2f}s -> {ratio:.0f}x {verdict(ratio >= 50)} (>=50)"
    )
    say(
        f"[{label}]     async background to S3 ({a['writer']}): write {bg['write']:.2f}s, "
        f"upload {bg['upload']:.2f}s, verify {bg['verify']:.2f}s"
    )
    say(
        f"[{label}]     notice -> durable in S3 (emergency save, nothing in flight): "
        f"{a['durable_after_notice_s']:.2f}s ({a['notice_ratio']:.2f}x the plain torch.save+upload_file)"
    )


def report_overhead(label: str, b: dict[str, Any]) -> None:
    each = ", ".join(f"{x:.2f}" for x in b["extra_s_each"])
    lengths = "/".join(map(str, b["steps_per_run"]))
    paired = ", ".join(f"{x:+.2f}" for x in b["paired_diff_s_each"])
    say(
        f"[{label}] (b) step {b['base_step_s']:.3f}s; one async checkpoint to a local dir costs the loop "
        f"{b['extra_s']:.2f}s (median of {b['pairs']} runs of {lengths} steps: {each})"
    )
    say(
        f"[{label}]     = stall {b['stall_s'] * 1e3:.0f} ms + {b['overlapped_steps']:.0f} steps beside the "
        f"background save, {b['slowdown_during_save'] or float('nan'):.2f}x slower + end wait <= "
        f"{b['tail_wait_s']:.2f}s"
    )
    ph = b["sync_phases_s"]
    say(
        f"[{label}]     the same save run synchronously: {b['sync_save_s']:.2f}s (write {ph['write']:.2f}s, "
        f"into the store {ph['upload']:.2f}s (renamed from its staging directory, one directory fsync "
        f"for the files and one for the manifest), read-back verify {ph['verify']:.2f}s)"
    )
    say(f"[{label}]     cross-check, whole run with minus without: {paired} s (machine noise included)")
    say(
        f"[{label}]     amortized over one checkpoint per {CHECKPOINT_EVERY_S:.0f}s of training: "
        f"{b['overhead_pct']:.2f}% {verdict(b['overhead_pct'] <= 2)} (<= 2%)"
    )


def report_validate(label: str, c: dict[str, Any]) -> None:
    ratio = c["validate_ratio"]
    say(
        f"[{label}] (c) validate_dir {c['validate_s']:.3f}s vs plain load {c['plain_load_s']:.3f}s -> "
        f"{ratio:.2f}x {verdict(ratio <= 1.5)} (<= 1.5x); fastest of 3, page cache warm for both"
    )
    spots = ", ".join(f"{name} {share:.0%}" for name, share in c["hot_spots"])
    say(
        f"[{label}]     sha256 of all {c['bytes'] / 1e6:.0f} MB alone {c['sha256_s']:.3f}s "
        f"({c['sha256_mb_s']:.0f} MB/s, one thread; validate hashes in 2 threads beside its loads); "
        f"main-thread time of validate_dir: {spots}"
    )
    say(f"[{label}]     for scale: load + load_state_dict into model and optimizer {c['resume_load_s']:.3f}s")


def report_transfer(d: dict[str, Any]) -> None:
    r, up, down = d["mb_s"], d["upload_ratio"], d["download_ratio"]
    say(
        f"(d) {d['object_mb']} MB object, fastest of {len(d['seconds']['put'])}: S3Storage.put "
        f"{r['put']:.0f} MB/s vs put_object {r['put_object']:.0f} MB/s -> {up:.2f}x {verdict(up >= 1)} (>= 1)"
    )
    say(
        f"(d) S3Storage.get {r['get']:.0f} MB/s vs get_object streamed to a file {r['get_object']:.0f} MB/s "
        f"(both fsynced) -> {down:.2f}x {verdict(down >= 1)} (>= 1)"
    )


def verdict(ok: bool) -> str:
    return "OK" if ok else "MISSED"


def summarize(
    sizes: dict[str, Any],
    transfer: dict[str, Any] | None,
    fsdp: dict[str, Any] | None,
    session: dict[str, Any] | None = None,
    capped: dict[str, Any] | None = None,
) -> dict[str, float | None]:
    """Worst case of each ratio over the sizes; the cases not run (`--only`) are left out."""
    out: dict[str, float | None] = {}
    if sizes:
        out |= {
            "stall_ratio": round(min(s["stall"]["stall_ratio"] for s in sizes.values()), 1),
            "overhead_pct": round(max(s["overhead"]["overhead_pct"] for s in sizes.values()), 2),
            "validate_ratio": round(max(s["validate"]["validate_ratio"] for s in sizes.values()), 2),
            "thread_overhead_pct": round(
                max(s["overhead"]["thread"]["overhead_pct"] for s in sizes.values()), 2
            ),
        }
        largest = max(sizes.values(), key=lambda s: s["state_bytes"])
        out["durable_after_notice_s"] = round(largest["stall"]["durable_after_notice_s"], 2)
        if (f := largest.get("signed")) is not None:
            for k in ("signed_overhead_pct", "signed_durable_pct", "signed_writer_cpu_pct"):
                out[k] = round(f[k], 1) if f[k] is not None else None
            out["signed_validate_ratio"] = round(f["signed_validate_ratio"], 2)
    if transfer is not None:
        out |= {
            "upload_ratio": round(transfer["upload_ratio"], 2),
            "download_ratio": round(transfer["download_ratio"], 2),
        }
    if fsdp is not None:
        out |= {
            "fsdp_stall_ratio": round(fsdp["stall_ratio"], 1),
            "fsdp_durable_ratio": round(fsdp["durable_ratio"], 2),
        }
    if session is not None:
        out["session_stall_ratio"] = round(session["session_stall_ratio"], 1)
    if capped is not None:
        for k in ("upload_ratio_capped", "download_ratio_capped", "ideal_ratio_capped"):
            out[k] = round(capped[k], 2)
        out["durable_after_notice_capped_s"] = round(capped["durable_after_notice_capped_s"], 2)
        out["ideal_upload_capped_s"] = round(capped["ideal_upload_capped_s"], 2)
        out["capped_state_gb"] = round(capped["state_bytes"] / 1e9, 2)
    return out


def machine_load() -> str:
    """Load average and, where the kernel reports it, how often a task waited for a CPU."""
    out = f"load average {os.getloadavg()[0]:.1f}"
    try:
        some = Path("/proc/pressure/cpu").read_text().split("\n")[0]  # "some avg10=.. avg60=.. ..."
        out += f", CPU pressure {dict(kv.split('=') for kv in some.split()[1:])['avg60']}% (avg60)"
    except (OSError, KeyError, ValueError):
        pass
    return out


def bench_single(s3: S3, work: Path, quick: bool) -> tuple[dict[str, Any], dict[str, Any]]:
    """(a)-(d) and (f): every size, then the transfer."""
    sizes: dict[str, Any] = {}
    plan = QUICK if quick else FULL
    for size in plan:
        signed_reps = SIGNED_REPS["quick" if quick else "full"] if size is plan[-1] else 0
        sizes[size.label] = bench_size(size, s3, work, budget_s=15 if quick else 60, signed_reps=signed_reps)
        gc.collect()
    mb = 10 if quick else 100
    say(
        f"(d) {mb} MB objects: moto holds request bodies in RAM and reads a whole object per GET, "
        "so 1 GB transfers measure moto more than the client"
    )
    transfer = measure_transfer(s3, "transfer", work, mb=mb)
    report_transfer(transfer)
    return sizes, transfer


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="~10 MB and ~50 MB states: a smoke run")
    ap.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's, one per core)")
    ap.add_argument(
        "--only",
        choices=("single", "fsdp", "session", "capped"),
        help="single: cases (a)-(d) and (f) only; fsdp: case (e) only; session: case (g) only; "
        "capped: case (h) only",
    )
    ap.add_argument("--cap-mb-s", type=float, default=DEFAULT_MB_S, help="(h): per-connection cap, MB/s")
    ap.add_argument("--latency-ms", type=float, default=DEFAULT_LATENCY_MS, help="(h): added per request")
    cli = ap.parse_args()
    quick = cli.quick
    if cli.threads:
        torch.set_num_threads(cli.threads)
    logging.basicConfig(level=logging.WARNING)
    # every case but (f) measures checkpoints without a key, whatever this shell holds
    for k in (KEY_ENV, OLD_KEYS_ENV):
        os.environ.pop(k, None)
    t0 = time.perf_counter()
    say(
        f"checkpoint benchmark: torch {torch.__version__}, {torch.get_num_threads()} threads, "
        f"{os.cpu_count()} CPUs, {machine_load()}"
    )
    sizes: dict[str, Any] = {}
    transfer, fsdp, session, capped = None, None, None, None
    if cli.only in (None, "capped"):
        with (
            capped_endpoint(cli.cap_mb_s, cli.latency_ms) as endpoint,
            tempfile.TemporaryDirectory(prefix="spotrun-bench-capped-") as tmp,
        ):
            largest = (QUICK if quick else FULL)[-1]
            capped = measure_capped(
                S3.connect(endpoint), Path(tmp), size=largest, mb_s=cli.cap_mb_s, latency_ms=cli.latency_ms
            )
        report_capped(capped)
    if cli.only not in ("fsdp", "capped"):
        with moto_endpoint() as endpoint, tempfile.TemporaryDirectory(prefix="spotrun-bench-") as tmp:
            s3 = S3.connect(endpoint)
            if cli.only != "session":
                sizes, transfer = bench_single(s3, Path(tmp), quick)
            if cli.only in (None, "session"):
                session = measure_session(s3, BUCKET, Path(tmp), quick)
                delete_prefix(s3.plain, session["prefix"])
                report_session(session, say, verdict)
    if cli.only in (None, "fsdp"):
        with tempfile.TemporaryDirectory(prefix="spotrun-bench-fsdp-") as tmp:
            fsdp = measure_fsdp(quick, Path(tmp))
        report_fsdp(fsdp)
    summary = summarize(sizes, transfer, fsdp, session=session, capped=capped)
    wall = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    OUT.parent.mkdir(parents=True, exist_ok=True)
    detail = {
        "summary": summary,
        "sizes": sizes,
        "transfer": transfer,
        "fsdp": fsdp,
        "session": session,
        "capped": capped,
        "wall_s": wall,
        "peak_rss_mb": peak,
    }
    OUT.write_text(json.dumps(detail, indent=2))
    say(
        f"wall {wall:.0f}s, peak RSS {peak:.0f} MB (this process, moto included; the FSDP ranks apart); "
        f"{machine_load()}"
    )
    say(f"details in {OUT}")
    print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
