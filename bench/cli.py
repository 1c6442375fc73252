"""CLI start-up benchmark: how long the commands a person types first take, against `import torch`.

Measured in one run, each command in a fresh process, the median of --repeat runs:
  - `spotrun --help` and `python -c "import torch"`: help_ratio = the first / the second (goal <= 0.25:
    the help must not pay for torch, Prefect or SQLAlchemy);
  - `spotrun history` on a SQLite history of 2 job runs (3 attempts);
  - `spotrun checkpoints list` and `checkpoints verify` on a small store (a digits job, 3 checkpoints,
    67 KiB each, written by `python -m spotrun.trainer` first).

Prints one line per command; the last line is one JSON object. Run from the repo root:
    .venv/bin/python bench/cli.py
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

REPO = Path(__file__).resolve().parents[1]
JOB = """name: bench-cli
recipe: digits
args: {hidden: 32}
total_steps: 21
batch_size: 64
seed: 1
threads: 1
num_workers: 0
checkpoint: {every_steps: 7, keep: 3}
"""


def timed(cmd: list[str], env: dict[str, str], repeat: int) -> float:
    """Median wall seconds of `cmd` in a fresh process; raises if it fails."""
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        r = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=REPO, timeout=300)
        times.append(time.perf_counter() - t0)
        if r.returncode != 0:
            raise SystemExit(f"{' '.join(cmd)} exited {r.returncode}: {r.stderr[-500:]}")
    return statistics.median(times)


def make_store(root: Path, env: dict[str, str]) -> Path:
    """A small real store: 21 digits steps, a checkpoint every 7."""
    job, store = root / "job.yaml", root / "store"
    job.write_text(JOB)
    cmd = [sys.executable, "-m", "spotrun.trainer", "--config", str(job), "--storage", str(store)]
    cmd += ["--cache", str(root / "cache"), "--metrics", str(root / "metrics.jsonl")]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=root, timeout=300)
    if r.returncode != 0:
        raise SystemExit(f"the trainer could not make the store: {r.stderr[-500:]}")
    return store


def make_history(home: Path) -> None:
    """Two job runs in the home's SQLite history: preempted then completed, and one crashed."""
    sys.path.insert(0, str(REPO))
    from spotrun.tasks.decisions.attempts import AttemptRecord, Outcome
    from spotrun.tasks.history import HistoryStore, JobStatus, default_url

    with HistoryStore.open(default_url(home)) as store:
        for job, outcomes in (
            ("digits", [Outcome.PREEMPTED, Outcome.COMPLETED]),
            ("other", [Outcome.CRASHED]),
        ):
            run = store.start_job_run(job, "hash", None, storage_uri=str(home / "store"), provider="local")
            for n, outcome in enumerate(outcomes, 1):
                t = time.time() - 100 + 10 * n
                store.record_attempt(
                    run,
                    AttemptRecord(
                        attempt=n,
                        worker_id=f"local-{n}",
                        provider="local",
                        started_at=t,
                        ended_at=t + 5,
                        outcome=outcome,
                        cause=outcome.value,
                        resumed_from=None,
                        last_step=7 * n,
                        lost_steps=0,
                        wall_s=5.0,
                    ),
                )
            status = JobStatus.COMPLETED if outcomes[-1] is Outcome.COMPLETED else JobStatus.FAILED
            store.finish_job_run(run, status, outcomes[-1].value)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeat", type=int, default=5, help="runs per command; the median counts (default 5)")
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="spotrun-bench-cli-") as d:
        root = Path(d)
        env = {k: v for k, v in os.environ.items() if not k.startswith(("SPOTRUN_", "PREFECT_API"))}
        env |= {"PYTHONPATH": str(REPO), "SPOTRUN_HOME": str(root / "home")}
        store = make_store(root, env)
        make_history(root / "home")
        spotrun = [sys.executable, "-m", "spotrun.cli"]
        result = {
            "help_s": timed([*spotrun, "--help"], env, args.repeat),
            "import_torch_s": timed([sys.executable, "-c", "import torch"], env, args.repeat),
            "history_s": timed([*spotrun, "history"], env, args.repeat),
            "checkpoints_list_s": timed([*spotrun, "checkpoints", "list", str(store)], env, args.repeat),
            "checkpoints_verify_s": timed([*spotrun, "checkpoints", "verify", str(store)], env, args.repeat),
        }
    result["help_ratio"] = result["help_s"] / result["import_torch_s"]
    for name, value in result.items():
        print(f"{name:22s} {value:.3f}")
    print(json.dumps({k: round(v, 3) for k, v in result.items()} | {"repeat": args.repeat}))


if __name__ == "__main__":
    main()
