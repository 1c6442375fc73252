"""Standby copies benchmark: what sending the state to a warm standby (`checkpoint.standby_every_s`,
trainer/saving/peer.py) costs the training loop, against the same trainer sending none.

Each round runs `python -m spotrun.trainer` on the demo's job (digits, threads 1, a checkpoint every 1.5 s of
training, as bench/recovery.py) twice, alternating which goes first, on its own empty storage:
  off     no standby record in the storage: the trainer finds no standby and sends nothing (it reads the
          standby record every 0.5 s);
  on      a standby's record names a receiver in this process (trainer/saving/peer.py's PeerReceiver,
          over loopback, as a standby trainer takes them): a copy every --every-s.
The pace is the trainer's own: its `step` status records' steps over their clock, from the first record
after `started` to the last (start-up and the final checkpoint excluded). copies_pace_cost =
median(on ms per step) / median(off ms per step) - 1; the load average is printed with it (2 shared
cores: the trainer, the copy's writer thread and the receiver compete for them, which a GPU box's
loop, running on the GPU, would not).

Prints human-readable lines; the last line is one JSON object. Run from the repo root:
    PYTHONPATH=. .venv/bin/python bench/standby_copies.py [--rounds 3] [--steps 8000] [--every-s 0.25]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

from spotrun.trainer.preemption.handover import write_standby
from spotrun.trainer.saving.peer import PeerReceiver
from spotrun.trainer.storage import open_storage
from spotrun.trainer.telemetry.records import Step
from spotrun.trainer.telemetry.status import parse_status_line

REPO = Path(__file__).resolve().parents[1]
DEMO_JOB = REPO / "deployments" / "jobs" / "digits.yaml"
WORKER = "bench-worker"


def job_file(where: Path, steps: int, every_s: float) -> Path:
    data = yaml.safe_load(DEMO_JOB.read_text())
    data.update(
        name="bench-standby-copies",
        total_steps=steps,
        threads=1,
        checkpoint={"every_steps": None, "every_seconds": 1.5, "keep": 3, "standby_every_s": every_s},
        tracking={"mlflow": False},
    )
    path = where / "job.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def run(where: Path, job: Path, copies: bool) -> tuple[float, int]:
    """ms per step of one trainer run, and the copies its standby received."""
    store = where / "store"
    receiver = None
    if copies:
        receiver = PeerReceiver(where / "received", max_bytes=1 << 30)
        write_standby(open_storage(str(store)), WORKER, "waiting", "bench-standby", peer=receiver.advert)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, "-m", "spotrun.trainer", "--config", str(job), "--storage", str(store)]
    cmd += ["--cache", str(where / "cache"), "--worker-id", WORKER]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900, check=False)
    if out.returncode != 0:
        raise SystemExit(f"trainer exited {out.returncode}: {out.stderr[-2000:]}")
    steps = [r for line in out.stdout.splitlines() if isinstance(r := parse_status_line(line), Step)]
    first, last = steps[1], steps[-1]  # the first record's gap includes the first step's imports
    received = receiver.received if receiver is not None else 0
    if receiver is not None:
        receiver.close()
    return 1000 * (last.t - first.t) / (last.step - first.step), received


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=8000)
    ap.add_argument("--every-s", type=float, default=0.25)
    args = ap.parse_args()
    t0 = time.perf_counter()
    paces: dict[str, list[float]] = {"off": [], "on": []}
    received: list[int] = []
    with tempfile.TemporaryDirectory(prefix="spotrun-bench-copies-") as tmp_name:
        tmp = Path(tmp_name)
        job = job_file(tmp, args.steps, args.every_s)
        for i in range(args.rounds):
            order = ("off", "on") if i % 2 == 0 else ("on", "off")
            for mode in order:
                where = tmp / f"{mode}-{i}"
                where.mkdir()
                ms, got = run(where, job, copies=mode == "on")
                paces[mode].append(ms)
                if mode == "on":
                    received.append(got)
                print(f"round {i + 1} {mode}: {ms:.3f} ms/step" + (f", {got} copies" if mode == "on" else ""))
    off, on = statistics.median(paces["off"]), statistics.median(paces["on"])
    load = os.getloadavg()[0]
    print(f"median {off:.3f} ms/step without copies, {on:.3f} with; load average {load:.2f}")
    summary = {
        "copies_pace_cost": round(on / off - 1, 3),
        "ms_per_step_off": round(off, 3),
        "ms_per_step_on": round(on, 3),
        "copies_per_run": statistics.median(received),
        "every_s": args.every_s,
        "rounds": args.rounds,
        "load_avg_1m": round(load, 2),
        "took_s": round(time.perf_counter() - t0),
    }
    print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
