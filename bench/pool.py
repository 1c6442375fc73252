"""Pool benchmark: a second job's first trainer start-up with a warm trainer pool (`provider.pool`)
against a private fork server started cold (what each flow run's controller pays without a pool).

Each round, in this process (a controller is a process; a new one is simulated by forgetting this
process's servers and connections):
  private  a LocalProvider with no pool and no server yet: provision -> the trainer's `started` record
           (the server's imports of torch, torch._dynamo and the training stack, the fork, the
           recipe's build, the empty-storage check);
  pool     a LocalProvider naming a pool whose server another job started earlier: the same span
           (a connection, the fork, the recipe's build, the check).
The job is the digits recipe, 20 steps, one thread, its own empty storage each time. Rounds
alternate private and pool, so both see the same machine; the figures are medians.
pool_ratio = pool / private (lower is better). The load average is printed with them: the 2 cores
are shared.

Prints human-readable lines; the last line is one JSON object. Run from the repo root:
    PYTHONPATH=. .venv/bin/python bench/pool.py [--rounds N]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import yaml

from spotrun.tasks.providers.local import LocalProvider, LocalProviderConfig, fork_server, pool
from spotrun.trainer.spec.job import JobSpec
from spotrun.trainer.telemetry.records import Record, Started


def first_start(provider: LocalProvider, tmp: Path, name: str) -> float:
    """Seconds from provision to the trainer's `started` record; the trainer then runs its 20 steps."""
    spec = {
        "name": name,
        "recipe": "digits",
        "args": {"hidden": 64},
        "total_steps": 20,
        "threads": 1,
        "seed": 1,
        "checkpoint": {"every_steps": 100, "keep": 2},
        "storage": str(tmp / name / "store"),
        "tracking": {"mlflow": False},
    }
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(spec))
    job = JobSpec.model_validate(spec)
    seen: list[float] = []

    def on_status(rec: Record) -> None:
        if isinstance(rec, Started) and not seen:
            seen.append(time.monotonic())

    t0 = time.monotonic()
    worker = provider.provision(job, 1, path, [])
    try:
        result = provider.watch(worker, on_status)
    finally:
        provider.release(worker)
    if not seen:
        raise SystemExit(f"{name}: no `started` record (exit {result.exit_code}): {result.log_tail}")
    return seen[0] - t0


def forget_servers() -> None:
    """What a new controller process has: no private server and no pool connection of its own."""
    for server in list(fork_server._servers.values()):
        server.close()
    fork_server._servers.clear()
    for conn in list(pool._pools.values()):
        conn.close()
    pool._pools.clear()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="spotrun-pool-bench-") as d:
        tmp = Path(d)
        home = tmp / "home"
        work = str(tmp / "work")
        private = LocalProviderConfig(workdir=work, prewarm=False)
        pooled = LocalProviderConfig(workdir=work, prewarm=False, pool="bench", pool_idle_s=120)
        place = pool.Place(pool.pools_dir(home), "bench")
        first_start(LocalProvider(pooled, home=home), tmp, "first-job")  # the job that starts the pool
        times: dict[str, list[float]] = {"private": [], "pool": []}
        for i in range(args.rounds):
            for kind, cfg in (("private", private), ("pool", pooled)):
                forget_servers()
                s = first_start(LocalProvider(cfg, home=home), tmp, f"{kind}-{i}")
                times[kind].append(s)
                print(f"round {i}: {kind:7s} first trainer started after {s:.2f} s", flush=True)
        forget_servers()
        pool.stop(place)
    load = os.getloadavg()
    p, c = statistics.median(times["pool"]), statistics.median(times["private"])
    print(f"median: pool {p:.2f} s, private cold {c:.2f} s; load average {load[0]:.2f} {load[1]:.2f}")
    out = {
        "pool_first_start_s": round(p, 2),
        "private_cold_first_start_s": round(c, 2),
        "pool_ratio": round(p / c, 2),
        "rounds": args.rounds,
        "load_avg_1m": round(load[0], 2),
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
