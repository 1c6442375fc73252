"""Scale benchmark: N jobs at once on one Prefect server and one history database, on SQLite and on
PostgreSQL; what each job's controller costs as N grows, and how late the zombie automation gets.

Every job's controller runs in a process of its own (bench/scale_run.py): the real control loop, the
Prefect sink, the job's slot and SQL history, over the fake provider, whose steps are paced on the wall
clock and whose first attempts are reclaimed with a notice. No trainers: 50 real jobs do not fit this
machine (~570 MB a job tree), and on 2 cores trainers would take the CPU the controllers are measured
on (docs/benchmarks.md). Per configuration, per job (median and p90 over the jobs):
  cpu_s_per_attempt        the controller process's CPU seconds (user + system, imports included)
                           over its attempts; flow_cpu_s_per_attempt the same after its imports
  peak_rss_mb              its peak resident memory
  overhead_s_per_attempt   its flow's wall time outside the attempts (flow start, provision, the
                           checks between attempts, the end), per attempt
  reclaim_to_next_start_s  a reclaimed attempt's end seen by the controller -> the next attempt's start
and once per configuration, a training run SIGKILLed after its first heartbeat: zombie.late_s, the
seconds from its last heartbeat plus the window (60 s, heartbeats every 30 s, as deployed) to its
Crashed state; cpu_busy, the machine's CPU busy fraction while the jobs ran. Latencies grow with N on
2 shared cores whatever the code does; read them beside cpu_busy.

overhead_growth: per-job controller cost at the largest N over N=1, on CPU seconds per attempt (after
imports, and with them) and peak RSS per job; goal <= 1.5. CPU seconds, not wall time: the machine is
shared with other work, and CPU time is what a job costs whoever else is running.

Last line: one JSON object. The curves go to docs/img/scale.png, the details to bench/out/scale.json.
Run from the repo root:
    .venv/bin/python bench/scale.py [--jobs 1,10,25,50] [--backends sqlite,postgresql]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # the fake provider and the database helpers live with the tests

from bench.scale_run import Config, run_config  # noqa: E402

OUT = REPO / "bench" / "out" / "scale.json"
PNG = REPO / "docs" / "img" / "scale.png"
GOAL = 1.5
MB_PER_JOB = 250  # a controller's peak RSS is ~150-200 MB: leave room before starting N of them


def say(msg: str) -> None:
    print(msg, flush=True)


def fits(jobs: int) -> str | None:
    """Why `jobs` controllers would not fit this machine's free memory now, or None."""
    avail_kb = int(
        next(
            x for x in Path("/proc/meminfo").read_text().splitlines() if x.startswith("MemAvailable")
        ).split()[1]
    )
    need_mb = jobs * MB_PER_JOB
    if avail_kb / 1024 < need_mb * 1.2:
        return f"{jobs} jobs need ~{need_mb} MB; {avail_kb // 1024} MB available"
    return None


def growth(results: list[dict[str, Any]], backend: str) -> dict[str, float | int | None]:
    """Per-job cost at the largest N over N=1 for one backend."""
    mine = sorted((r for r in results if r["backend"] == backend), key=lambda r: r["jobs"])
    if len(mine) < 2 or mine[0]["jobs"] != 1:
        return {}
    one, big = mine[0]["median"], mine[-1]["median"]

    def ratio(key: str) -> float | None:
        return round(big[key] / one[key], 3) if one.get(key) and big.get(key) is not None else None

    return {
        "jobs": mine[-1]["jobs"],
        "flow_cpu_s_per_attempt": ratio("flow_cpu_s_per_attempt"),
        "cpu_s_per_attempt": ratio("cpu_s_per_attempt"),
        "peak_rss_mb": ratio("peak_rss_mb"),
    }


def curve(results: list[dict[str, Any]], backend: str, key: str, part: str = "median") -> list[Any]:
    mine = sorted((r for r in results if r["backend"] == backend), key=lambda r: r["jobs"])
    out = []
    for r in mine:
        v = r["zombie"].get(key) if part == "zombie" else r.get(key) if part == "top" else r[part].get(key)
        out.append(None if v is None else round(v, 3))
    return out


def curves(results: list[dict[str, Any]], backend: str) -> dict[str, list[Any]]:
    return {
        "jobs": curve(results, backend, "jobs", "top"),
        "completed": curve(results, backend, "completed", "top"),
        "cpu_s_per_attempt": curve(results, backend, "cpu_s_per_attempt"),
        "flow_cpu_s_per_attempt": curve(results, backend, "flow_cpu_s_per_attempt"),
        "peak_rss_mb": curve(results, backend, "peak_rss_mb"),
        "overhead_s_per_attempt": curve(results, backend, "overhead_s_per_attempt"),
        "overhead_s_per_attempt_p90": curve(results, backend, "overhead_s_per_attempt", "p90"),
        "reclaim_to_next_start_s": curve(results, backend, "reclaim_to_next_start_s"),
        "reclaim_to_next_start_s_p90": curve(results, backend, "reclaim_to_next_start_s", "p90"),
        "zombie_late_s": curve(results, backend, "late_s", "zombie"),
        "cpu_busy": curve(results, backend, "cpu_busy", "top"),
    }


def plot(summary: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [
        ("flow_cpu_s_per_attempt", "controller CPU s / attempt (after imports)"),
        ("peak_rss_mb", "controller peak RSS (MB)"),
        ("overhead_s_per_attempt", "flow overhead s / attempt (median)"),
        ("reclaim_to_next_start_s", "reclaim -> next attempt start (s, median)"),
        ("zombie_late_s", "zombie marked Crashed: s past the window"),
        ("cpu_busy", "CPU busy while the jobs ran (2 cores)"),
    ]
    fig, axes = plt.subplots(2, 3, figsize=(14, 7.5))
    for ax, (key, title) in zip(axes.flat, panels, strict=True):
        for backend, c in summary["curves"].items():
            pts = [(x, y) for x, y in zip(c["jobs"], c[key], strict=True) if y is not None]
            if pts:
                ax.plot(*zip(*pts, strict=True), marker="o", label=backend)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("concurrent jobs")
        ax.set_ylim(bottom=0)  # growth is read against zero, not magnified
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("bench/scale.py: one Prefect server, one history database, N controllers (fake provider)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--jobs", default="1,10,25,50", help="comma-separated concurrent job counts")
    p.add_argument("--backends", default="sqlite,postgresql")
    p.add_argument("--steps", type=int, default=300, help="steps per job")
    p.add_argument("--pace", type=float, default=0.1, metavar="S", help="wall seconds per fake step")
    p.add_argument("--reclaims", type=int, default=2, help="attempts reclaimed with a notice per job")
    p.add_argument("--zombie-after", type=float, default=60, metavar="S", help="the zombie window")
    p.add_argument("--png", type=Path, default=PNG)
    args = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="spotrun-scale-"))
    results: list[dict[str, Any]] = []
    skipped: list[str] = []
    t0 = time.monotonic()
    try:
        for backend in args.backends.split(","):
            if backend == "postgresql":
                from tests.prefect_postgres import unreachable

                why = unreachable()
                if why:
                    skipped.append(f"{backend}: {why}")
                    continue
            for jobs in [int(x) for x in args.jobs.split(",")]:
                why = fits(jobs)
                if why:
                    skipped.append(f"{backend} x{jobs}: {why}")
                    say(f"skipped {backend} x{jobs}: {why}")
                    continue
                cfg = Config(
                    backend=backend,
                    jobs=jobs,
                    steps=args.steps,
                    pace_s=args.pace,
                    reclaims=args.reclaims,
                    zombie_after_s=args.zombie_after,
                    out=work / f"{backend}-{jobs}",
                )
                say(f"{backend} x{jobs}: running (load average {os.getloadavg()[0]:.1f}) ...")
                r = run_config(cfg)
                results.append(r)
                OUT.parent.mkdir(parents=True, exist_ok=True)
                OUT.with_suffix(".partial.json").write_text(json.dumps(results, indent=2))
                m = r["median"]
                say(
                    f"  {r['completed']}/{jobs} completed in {r['wall_s']:.0f} s, CPU busy "
                    f"{(r['cpu_busy'] or 0):.0%}; per job: {m.get('cpu_s_per_attempt', 0):.2f} CPU s/attempt "
                    f"({m.get('flow_cpu_s_per_attempt', 0):.2f} after imports), "
                    f"{m.get('peak_rss_mb', 0):.0f} MB, "
                    f"overhead {m.get('overhead_s_per_attempt', 0):.2f} s/attempt, "
                    f"reclaim->next {m.get('reclaim_to_next_start_s', 0):.2f} s; zombie late "
                    f"{r['zombie']['late_s'] or float('nan'):.1f} s"
                )
    finally:
        shutil.rmtree(work, ignore_errors=True)
    backends = sorted({r["backend"] for r in results})
    summary: dict[str, Any] = {
        "bench": "scale",
        "cores": os.cpu_count(),
        "steps": args.steps,
        "pace_s": args.pace,
        "reclaims": args.reclaims,
        "zombie_after_s": args.zombie_after,
        "curves": {b: curves(results, b) for b in backends},
        "overhead_growth": {b: growth(results, b) for b in backends},
        "goal": GOAL,
        "skipped": skipped,
        "took_s": round(time.monotonic() - t0),
    }
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps({**summary, "results": results}, indent=2))
    if results:
        plot(summary, args.png)
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
