"""Deadline benchmark: a job of fixed work, finished by its deadline for the least money, on real spot
capacity traces, under each policy of tasks/deadlines/policy.py and against the omniscient optimum.

    python bench/deadline.py --traces DIR [DIR ...] [--slack 1.1,1.25,1.5,1.75,2.0]
                             [--restart-overhead-s 600] [--work-h 8] [--starts 4] [--regions]

Each `*.json` in a DIR is one zone's trace (tasks/market/traces.py), each sub-folder a multi-zone
region on one clock; `--regions` also forms a region of the zones whose names share a prefix
(`us-east-1a`, `us-east-1c`, ... make `us-east-1`). For every trace, every slack (the deadline as a
multiple of the job's on-demand duration, its restart included) and `--starts` start times spread over
the trace's second half (the first half, or at least three days, is the history the policies may
read), each policy runs through simulate.py's tick rules; optimum.py gives the least cost possible.
Baselines, in the same run: all on-demand; greedy (spot until the slack is gone, then on-demand);
uniform progress as published (Wu et al., NSDI '24); the optimum.

Prices default to a p3.2xlarge in us-east-1 (on-demand $3.06/h, spot $0.918/h: 30%, the traces hold
capacity, not prices). The restart overhead is what a start costs (provision, restore, warm-up): spotrun
measures it per job; 600 s is a cold GPU worker's.

Per-case results go to bench/out/deadline/<trace>.json and a PNG of cost against slack (one line per
policy, means over traces and starts) to bench/out/deadline/cost_vs_slack.png. The last line is JSON:
ratios are means over traces, slacks and starts of spotrun's cost over each baseline's; deadlines_met
counts the cases spotrun met (of `cases`). `e2e_agrees`: one dated job replayed end to end through the
control loop and real trainers on a compressed stretch of one of the traces ran the same markets in
the same order as its simulation fed the product's measured step rate and start cost, and both met
the deadline (bench/deadline_e2e.py; ~1.5 min; `--no-e2e` skips it: null); `e2e_cost_ratio` is the
replay's cost over the simulation's. Details in bench/out/deadline/e2e.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict
from pathlib import Path
from statistics import mean
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.deadline_e2e import e2e_replay
from spotrun.tasks.deadlines.optimum import optimum_cost
from spotrun.tasks.deadlines.policy import POLICIES
from spotrun.tasks.deadlines.simulate import Job, simulate
from spotrun.tasks.market.traces import DAY_S, Trace, load

OUT = Path(__file__).resolve().parent / "out" / "deadline"
BASELINES = ("on-demand", "greedy", "uniform-progress")


def trace_sets(dirs: list[Path], regions: bool) -> dict[str, list[Trace]]:
    """Name -> the zones of one case: each file alone, each sub-folder, and (`regions`) each prefix."""
    sets: dict[str, list[Trace]] = {}
    for d in dirs:
        by_region: dict[str, list[Trace]] = defaultdict(list)
        for f in sorted(d.glob("*.json")):
            (t,) = load(f)
            sets[f"{d.name}.{t.zone}"] = [t]
            by_region[t.zone[:-1]].append(t)
        for sub in sorted(p for p in d.iterdir() if p.is_dir()):
            sets[f"{d.name}.{sub.name}"] = load(sub)
        for region, zones in by_region.items() if regions else ():
            if len(zones) > 1 and len({(z.gap_s, len(z)) for z in zones}) == 1:
                sets[f"{d.name}.{region}"] = zones
    return sets


def run_case(zones: list[Trace], *, slack: float, start: int, args: argparse.Namespace) -> dict[str, Any]:
    gap = zones[0].gap_s
    work_s, restart_s = args.work_h * 3600, args.restart_overhead_s
    job = Job.of(
        work_s=work_s,
        deadline_s=slack * (work_s + restart_s),
        restart_s=restart_s,
        gap_s=gap,
        spot_per_h=args.spot_per_h,
        on_demand_per_h=args.on_demand_per_h,
    )
    out: dict[str, Any] = {"start": start, "slack": slack, "on_demand_cost": job.on_demand_cost}
    for name, policy in POLICIES.items():
        # spotrun's as its controller asks it: a running spot worker is not asked (it ends with its
        # reclaim); the baselines as published, asked every tick
        run = simulate(policy, zones, job, start=start, keep_spot=name == "spotrun")
        out[name] = run.cost if run.met(job) else float("inf")
        out[f"{name}_preemptions"] = run.preemptions
    out["optimum"] = optimum_cost(zones, job, start=start)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--traces", type=Path, nargs="+", required=True)
    p.add_argument("--slack", default="1.1,1.25,1.5,1.75,2.0")
    p.add_argument("--restart-overhead-s", type=float, default=600.0)
    p.add_argument("--work-h", type=float, default=8.0)
    p.add_argument("--starts", type=int, default=4)
    p.add_argument("--spot-per-h", type=float, default=0.918)
    p.add_argument("--on-demand-per-h", type=float, default=3.06)
    p.add_argument("--regions", action="store_true")
    p.add_argument("--out", type=Path, default=OUT)
    p.add_argument("--no-e2e", action="store_true", help="skip the end-to-end replay (e2e_agrees: null)")
    args = p.parse_args()
    try:
        slacks = [float(x) for x in args.slack.split(",")]
    except ValueError:
        print(f"--slack {args.slack!r}: give numbers like 1.1,1.5,2.0", file=sys.stderr)
        return 2
    if any(s < 1 for s in slacks):
        print("--slack below 1: no policy meets a deadline shorter than the work", file=sys.stderr)
        return 2
    for d in args.traces:
        if not d.is_dir():
            print(f"--traces {d}: not a folder of trace files", file=sys.stderr)
            return 2
    t0 = time.monotonic()
    sets = trace_sets(args.traces, args.regions)
    args.out.mkdir(parents=True, exist_ok=True)
    rows: list[dict[str, Any]] = []
    for name, zones in sets.items():
        n, gap = len(zones[0]), zones[0].gap_s
        history = max(int(3 * DAY_S / gap), n // 2)
        usable = n - history
        starts = [history + usable * i // args.starts for i in range(args.starts)]
        cases = [
            run_case(zones, slack=s, start=st, args=args) | {"trace": name} for s in slacks for st in starts
        ]  # type: ignore[operator]
        (args.out / f"{name}.json").write_text(json.dumps(cases, indent=1))
        rows += cases
        sr = mean(c["spotrun"] / c["on_demand_cost"] for c in cases)
        up = mean(c["uniform-progress"] / c["on_demand_cost"] for c in cases)
        print(
            f"{name:34s} zones {len(zones)}  spotrun {sr:.3f}  uniform-progress {up:.3f} of on-demand",
            flush=True,
        )

    def ratio(policy: str, base: str) -> float:
        return mean(r[policy] / r[base] for r in rows)

    by_slack = {
        s: {
            pol: mean(r[pol] / r["on_demand_cost"] for r in rows if r["slack"] == s)
            for pol in (*POLICIES, "optimum")
        }
        for s in slacks
    }
    for s, costs in by_slack.items():
        print(f"slack {s:4.2f}: " + "  ".join(f"{k} {v:.3f}" for k, v in costs.items()))
    gaps = [r for r in rows if r["spotrun"] > 1.10 * r["optimum"]]
    worse = [r for r in rows if r["spotrun"] > r["uniform-progress"] * (1 + 1e-9)]
    print(
        f"cases over 10% above the optimum: {len(gaps)} of {len(rows)}; above uniform progress: {len(worse)}"
    )
    _plot(by_slack, args.out / "cost_vs_slack.png")
    e2e: dict[str, Any] = {"agrees": None, "cost_ratio": None} if args.no_e2e else e2e_replay(sets, args.out)
    if e2e.get("why"):
        print(f"end-to-end replay not run: {e2e['why']}")
    elif not args.no_e2e:
        product, sim = e2e["product"], e2e["simulation"]
        print(
            f"end-to-end replay of {e2e['trace']} from tick {e2e['start_tick']}: product {product['markets']}"
            f" (${product['cost_usd']:.4f}, met {product['met']}), simulation {sim['markets']}"
            f" (${sim['cost_usd']:.4f}, met {sim['met']})"
        )
    summary = {
        "traces": len(sets),
        "cases": len(rows),
        "deadlines_met": sum(1 for r in rows if r["spotrun"] != float("inf")),
        "cost_vs_on_demand": round(mean(r["spotrun"] / r["on_demand_cost"] for r in rows), 4),
        "cost_vs_uniform_progress": round(ratio("spotrun", "uniform-progress"), 4),
        "cost_vs_optimum": round(ratio("spotrun", "optimum"), 4),
        "uniform_progress_vs_optimum": round(ratio("uniform-progress", "optimum"), 4),
        "greedy_vs_optimum": round(ratio("greedy", "optimum"), 4),
        "over_10pct_of_optimum": len(gaps),
        "worse_than_uniform_progress": len(worse),
        "e2e_agrees": e2e["agrees"],
        "e2e_cost_ratio": e2e.get("cost_ratio"),
        "seconds": round(time.monotonic() - t0, 1),
    }
    print(json.dumps(summary))
    return 0


def _plot(by_slack: dict[float, dict[str, float]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    slacks = sorted(by_slack)
    for policy in next(iter(by_slack.values())):
        ax.plot(slacks, [by_slack[s][policy] for s in slacks], marker="o", label=policy)
    ax.set_xlabel("deadline / on-demand duration")
    ax.set_ylabel("cost / all on-demand")
    ax.set_title("Cost against slack (means over traces and starts)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
