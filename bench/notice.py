"""Notice benchmark: the steps a preemption loses with a cloud notice vs without, and the largest
state a notice window can make durable.

Measured in one run:
  (a) lost steps: a digits job checkpointing every 50 steps, reclaimed repeatedly at random points
      (40-160 steps into each attempt), each attempt a `python -m spotrun.trainer` process resuming the last.
      With notice: the local IMDS stand-in (tests/fakes/imds.py) announces a spot termination 120 s
      ahead; the trainer stops at the next step boundary and takes an emergency checkpoint.
      Lost = the exit record's step minus its durable step. Baseline, without notice: SIGKILL at a
      random point; lost = the last finished step (metrics file) minus the newest committed
      checkpoint in storage. Goal: 0 lost steps with notice.
  (b) bandwidth: Checkpointer.save(wait=True) of a ~50 MB charlm state, 3 times, to LocalStorage
      and to S3 (moto on 127.0.0.1, a stand-in: it measures moto more than S3). Reported as the
      trainer's own estimate uses it: Checkpointer.bandwidth(), write (snapshot + local write) and
      upload (upload + read-back), the slowest of the three; combined = 1 / (1/write + 1/upload).
  (c) from (b): the largest state durable within a 30 s (GCP, Azure) and 120 s (AWS) notice:
      combined bandwidth x (window - poll interval 5 s - save margin 5 s - one training step of the
      measured state). The poll interval is subtracted too: a notice can wait that long to be seen.

Prints human-readable lines; the last line is one JSON object. Details go to bench/out/notice.json.
Run from the repo root:
    .venv/bin/python bench/notice.py
"""

from __future__ import annotations

import functools
import json
import logging
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # the stand-in IMDS lives with the tests, the charlm harness beside us

from bench.checkpoint import S3, Size, Trainee, machine_load, moto_endpoint  # noqa: E402
from spotrun.trainer.checkpoint.catalog import list_checkpoints  # noqa: E402
from spotrun.trainer.checkpoint.state import state_nbytes  # noqa: E402
from spotrun.trainer.saving.checkpointer import Checkpointer  # noqa: E402
from spotrun.trainer.spec.job import parse_spec  # noqa: E402
from spotrun.trainer.storage import LocalStorage, Storage  # noqa: E402
from spotrun.trainer.telemetry.status import parse_status_line  # noqa: E402
from tests.fakes.imds import FakeIMDS  # noqa: E402

OUT = REPO / "bench" / "out" / "notice.json"
MB = 1e6
TRIALS = 5
EVERY_STEPS = 50
NOTICE_S = 120.0
POLL_S, MARGIN_S = 5.0, 5.0  # the spec's defaults, for (c)
WINDOWS = (30.0, 120.0)
STATE = Size("50MB", {"d_model": 256, "n_layers": 5, "seq_len": 64, "dropout": 0.0}, 4, 3)


def say(msg: str) -> None:
    print(msg, flush=True)


# ---------------------------------------------------------------- (a) lost steps


def write_job(path: Path, notice: str) -> Path:
    spec = parse_spec(
        {
            "name": "bench-notice",
            "recipe": "digits",
            "args": {"hidden": 256, "dropout": 0.1, "lr": 0.003},
            "total_steps": 1_000_000,
            "batch_size": 64,
            "threads": 1,
            "log_every": 1_000_000,
            "checkpoint": {"every_steps": EVERY_STEPS, "keep": 2},
            "preemption": {"notice": notice, "poll_s": 0.5},
        }
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(spec.model_dump(mode="json"), sort_keys=False))
    return path


Reclaim = Callable[[subprocess.Popen[str]], None]


def attempt(
    work: Path, job: Path, after: int, *, reclaim: Reclaim, env: dict[str, str]
) -> tuple[int, list[dict[str, Any]], float]:
    """One trainer process, reclaimed `after` steps in: (last finished step, records, reclaim -> exit s)."""
    metrics = work / "metrics.jsonl"
    start = _lines(metrics)
    cmd = [sys.executable, "-m", "spotrun.trainer", "--config", str(job), "--storage", str(work / "store")]
    cmd += ["--metrics", str(metrics), "--cache", str(work / "cache")]
    with open(work / "stdout", "w") as out:
        full_env = {**os.environ, "PYTHONPATH": str(REPO), **env}
        proc = subprocess.Popen(cmd, cwd=work, env=full_env, stdout=out, stderr=subprocess.DEVNULL, text=True)
        deadline = time.monotonic() + 120
        while _lines(metrics) - start < after and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.002)
        t0 = time.perf_counter()
        reclaim(proc)
        proc.wait(timeout=120)
        gone = time.perf_counter() - t0
    records = [
        r.to_json() for line in (work / "stdout").read_text().splitlines() if (r := parse_status_line(line))
    ]
    last = json.loads(metrics.read_text().splitlines()[-1])["step"]
    return last, records, gone


def _lines(p: Path) -> int:
    try:
        return p.read_bytes().count(b"\n")
    except FileNotFoundError:
        return 0


def newest_committed(storage: Storage) -> int:
    return max((s for s, c in list_checkpoints(storage).items() if c.committed), default=0)


def _interrupt(imds: FakeIMDS, _proc: subprocess.Popen[str]) -> None:
    imds.interrupt(in_seconds=NOTICE_S)


def lost_with_notice(work: Path, rng: random.Random) -> list[dict[str, Any]]:
    job, out = write_job(work / "job.yaml", "aws"), []
    for _ in range(TRIALS):
        imds, after = FakeIMDS(), rng.randint(40, 160)
        try:
            notice: Reclaim = functools.partial(_interrupt, imds)
            _, records, gone = attempt(
                work, job, after, reclaim=notice, env={"SPOTRUN_IMDS_ENDPOINT": imds.endpoint}
            )
        finally:
            imds.close()
        exit_ = next(r for r in records if r["kind"] == "exit")
        stopping = next(r for r in records if r["kind"] == "stopping")
        lost = exit_["step"] - (exit_["durable_step"] or 0)
        out.append(
            {
                "after": after,
                "step": exit_["step"],
                "durable": exit_["durable_step"],
                "lost": lost,
                "code": exit_["name"],
                "notice_to_exit_s": gone,
                "save": stopping.get("save"),
                "save_reason": stopping.get("save_reason"),
            }
        )
        say(
            f"(a) notice after {after} steps: stopped at {exit_['step']}, durable {exit_['durable_step']}, "
            f"lost {lost}, {exit_['name']} {gone:.2f}s after the notice ({stopping.get('save_reason')})"
        )
    return out


def lost_without_notice(work: Path, rng: random.Random) -> list[dict[str, Any]]:
    job, out = write_job(work / "job.yaml", "none"), []
    storage = LocalStorage(work / "store")
    for _ in range(TRIALS):
        after = rng.randint(40, 160)
        last, _records, _ = attempt(work, job, after, reclaim=lambda p: p.send_signal(signal.SIGKILL), env={})
        durable = newest_committed(storage)
        out.append({"after": after, "step": last, "durable": durable, "lost": last - durable})
        say(
            f"(a) SIGKILL after {after} steps: last step {last}, newest checkpoint {durable}, "
            f"lost {last - durable}"
        )
    return out


# ---------------------------------------------------------------- (b) bandwidth, (c) max state


def bandwidth(t: Trainee, storage: Storage, cache: Path) -> dict[str, float]:
    ckpt = Checkpointer(storage, cache, keep=2, background=False)
    for _ in range(3):
        t.train_step()
        t.save(ckpt, wait=True)
    measured = ckpt.bandwidth()
    assert measured is not None
    write, upload = measured
    last = ckpt.history[-1]
    combined = 1 / (1 / write + 1 / upload)
    return {
        "write_mbps": write / MB,
        "upload_mbps": upload / MB,
        "combined_mbps": combined / MB,
        "durable_s": last.total_s,
        "checkpoint_mb": last.nbytes / MB,
    }


def step_seconds(t: Trainee, n: int = 3) -> float:
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        t.train_step()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def max_state_mb(combined_mbps: float, window_s: float, step_s: float) -> float:
    return max(0.0, combined_mbps * (window_s - POLL_S - MARGIN_S - step_s))


def main() -> None:
    logging.basicConfig(level=logging.WARNING)
    t0 = time.perf_counter()
    rng = random.Random(20260)
    say(f"notice benchmark: {os.cpu_count()} CPUs, {machine_load()}")
    with tempfile.TemporaryDirectory(prefix="spotrun-bench-notice-") as tmp:
        work = Path(tmp)
        without = lost_without_notice(work / "kill", rng)
        with_ = lost_with_notice(work / "notice", rng)
        t = Trainee.build(STATE)
        step_s = step_seconds(t)
        say(f"(b) charlm {STATE.args}: state {state_nbytes(t.capture()) / MB:.0f} MB, one step {step_s:.2f}s")
        bw = {"local": bandwidth(t, LocalStorage(work / "remote"), work / "cache-local")}
        with moto_endpoint() as endpoint:
            bw["s3_moto"] = bandwidth(t, S3.connect(endpoint).storage("notice"), work / "cache-s3")
    fit: dict[str, dict[str, float]] = {}  # storage -> window -> largest state durable within it
    for name, b in bw.items():
        say(
            f"(b) {name}: write {b['write_mbps']:.0f} MB/s, upload+verify {b['upload_mbps']:.0f} MB/s -> "
            f"{b['combined_mbps']:.0f} MB/s ({b['checkpoint_mb']:.0f} MB durable in {b['durable_s']:.2f}s)"
        )
        fit[name] = {f"{w:g}s": max_state_mb(b["combined_mbps"], w, step_s) for w in WINDOWS}
        fits = ", ".join(f"{mb:,.0f} MB in {w}" for w, mb in fit[name].items())
        say(
            f"(c) {name}: largest state durable within a notice: {fits} "
            f"(window - poll {POLL_S:g}s - margin {MARGIN_S:g}s - one step {step_s:.2f}s)"
        )
    lw = statistics.mean(r["lost"] for r in with_)
    lo = statistics.mean(r["lost"] for r in without)
    say(
        f"(a) lost steps per preemption: {lw:.1f} with notice vs {lo:.1f} without (SIGKILL, checkpoint "
        f"every {EVERY_STEPS} steps) -> {lw / lo if lo else 0:.2f}x; {'OK' if lw == 0 else 'MISSED'} (goal 0)"
    )
    summary = {
        "lost_steps_with_notice": round(lw, 2),
        "lost_steps_without_notice": round(lo, 2),
        "lost_ratio": round(lw / lo, 3) if lo else 0.0,
        "notice_to_exit_s": round(max(r["notice_to_exit_s"] for r in with_), 2),
        "max_state_mb_30s": round(fit["local"]["30s"]),
        "max_state_mb_120s": round(fit["local"]["120s"]),
        "max_state_mb_30s_s3_moto": round(fit["s3_moto"]["30s"]),
        "max_state_mb_120s_s3_moto": round(fit["s3_moto"]["120s"]),
        "local_combined_mbps": round(bw["local"]["combined_mbps"], 1),
        "s3_moto_combined_mbps": round(bw["s3_moto"]["combined_mbps"], 1),
    }
    wall = time.perf_counter() - t0
    OUT.parent.mkdir(parents=True, exist_ok=True)
    detail = {
        "summary": summary,
        "with_notice": with_,
        "without_notice": without,
        "bandwidth": bw,
        "step_s": step_s,
        "wall_s": wall,
    }
    OUT.write_text(json.dumps(detail, indent=2))
    say(f"wall {wall:.0f}s; {machine_load()}; details in {OUT}")
    print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
