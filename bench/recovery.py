"""Recovery benchmark: the goodput of a real run under a synthetic spot trace, against the same run
uninterrupted, and what each reclaim costs.

The demo's job (deployments/jobs/digits.yaml, raised to DEFAULT.total_steps: ~60-120 s of training
on 2 cores) goes through the real flow (flows.resilient_training, a local Prefect server, the local
provider's `python -m spotrun.trainer` workers; replacements prewarmed at the notice, the default), all in
this process:
  A   uninterrupted: no reclaims (with B's standby and its copies, --warm: the same setup as B);
  (an untimed warm-up run first: a process's first flow run pays one-time costs)
  B   interrupted: the spot simulator's seeded exponential reclaims, a mean of DEFAULT.mean_s seconds of
      training between them (20x the checkpoint interval, checkpoint.every_seconds), a third of them
      (--no-notice-fraction) without notice (SIGKILL), the others with a notice (SIGTERM, then SIGKILL
      30 s later, as on GCP; the old worker trains through it until its replacement stands by); with
      `warm: 1` (--warm): a standby trainer waits on the lease from each attempt's start
      (tasks/control/warm.py), and a reclaim without notice hands over to it; the running trainer
      sends it a copy of its state every --standby-every-s (0.25 s; trainer/saving/peer.py), which it
      resumes from when newer than the last checkpoint;
  A'  uninterrupted again (default mode only): the machine is shared, so the baseline is the mean of
      the runs before and after B;
  E   (with --warm 1) uninterrupted without a standby: what the standby and its copies cost the pace
      of ordinary steps on these shared cores (`standby_pace_cost`, A's and A''s ms per step over E's,
      less 1; the pace moves by ~5% between runs here, so read it as a bound, not a figure);
  D   (with --warm 1 and a reclaim without notice in the trace) B's trace again with no standby: each
      reclaim without notice pays a cold start and loses the training since the last checkpoint, the
      figures a standby is measured against. Not part of goodput.
goodput = uninterrupted wall / interrupted wall, each from the call of the flow to its return, with
the uninterrupted runs' training priced at B's pace per ordinary step (the same job's pace moved from
3.9 to 5.7 ms/step between two runs on the shared cores); goodput_as_measured is the plain ratio.
Where the extra wall time of B went: the reclaims' costs (they add up to the gaps in B's timeline),
start-up, finish, and the pace.

Also measured, from the same runs (bench/recovery_run.py says where each clock reading comes from:
SQL history, the trainers' own per-step times in storage, the provider's simulator log):
  recovery_with_notice_s  per reclaim with notice: the replacement's first step - the old worker's
                          last step (both the trainers' own clocks); the median
  recovery_ratio          median recovery (death seen by the flow -> first resumed step) over all
                          reclaims / a cold start of the same trainer: provision -> first step of a
                          fresh `python -m spotrun.trainer` on empty storage (run C: the provider's fork
                          server off, as a naive restart pays it). Goal <= 1.0. Also printed, not a goal: the
                          same recovery over the forked first attempts' start (the fork server's best
                          case, which has no checkpoint to load)
  recovery_no_notice_s    per reclaim without notice in B (with its standby): death seen by the flow ->
                          first resumed step; the median. Goal <= 0.5 s with warm: 1
  recovery_no_notice_cold_s  the same in D (no standby: a forked cold start, restore, first step)
  overhead_s              the flow's own time per attempt outside any trainer (flow start or the last
                          trainer's exit seen -> the next trainer's process start); median over the
                          attempts started cold (a prewarmed one starts before the old one is gone:
                          no such time). Goal <= 2 s
and, per reclaim, where its time went: lost training, stop + save, detection, flow, start-up.

The trace's seed: the first seed (from --seed, default 0) whose draws within A's seconds of training
are as many as expected (training / mean, rounded) and, two or more, of both kinds; so a ~90 s run
rehearses a typical count and both paths (seed 0 at a 30 s mean draws 3 notices and no hard kill).
--exact-seed takes the seed as given.

Prints human-readable lines; the last line is one JSON object. Details go to bench/out/recovery.json.
Run from the repo root:
    .venv/bin/python bench/recovery.py [--quick]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import signal
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import yaml  # noqa: E402

from bench.recovery_run import Attempt, FlowRun, prefect_server, run_flow  # noqa: E402
from spotrun.tasks.providers.local import (  # noqa: E402
    LocalProviderConfig,
    PlannedPreemption,
    SpotSimulatorConfig,
    plan_preemption,
    simulator_rng,
)
from spotrun.trainer.spec.job import JobSpec, parse_spec  # noqa: E402

OUT = REPO / "bench" / "out" / "recovery.json"
DEMO_JOB = REPO / "deployments" / "jobs" / "digits.yaml"
GOAL_GOODPUT, GOAL_RATIO, GOAL_OVERHEAD_S = 0.98, 1.0, 2.0
GOAL_NO_NOTICE_S = 0.5  # a reclaim without notice, death seen -> first resumed step, with a standby
NO_NOTICE = 1 / 3  # share of reclaims without notice
STANDBY_EVERY_S = 0.25  # copies of the state to the warm standby (checkpoint.standby_every_s)
NOTICE_S = 30.0  # notice -> SIGKILL of the simulated reclaims with notice
MAX_SEEDS = 100
WARM_UP_STEPS = 200  # an untimed run first: the process's first flow run was 2.4 s slower to its first step


@dataclass(frozen=True)
class Size:
    total_steps: int
    mean_s: float  # mean seconds of training between reclaims
    baselines: int  # uninterrupted runs: 2 bracket the interrupted one

    @property
    def every_s(self) -> float:
        """The checkpoint interval: a twentieth of the mean time between reclaims (the trace's mean is
        then 20x the interval; at least 10x is the rule). Young/Daly, sqrt(2 C M), for this job's
        measured cost per checkpoint (C ~ 0.02 s of a ~1 ms stall and the writer's ~20 ms beside the
        loop) and M = 30 s gives 1.1 s: 1.5 s is near the optimum, 3 s lost twice the training per kill."""
        return self.mean_s / 20


# 280-300 steps/s on 2 loaded cores (load average 3-4) with threads 1: ~85 s of training; quick ~20 s.
DEFAULT, QUICK = Size(24_000, 30.0, 2), Size(6_000, 10.0, 1)


def say(msg: str) -> None:
    print(msg, flush=True)


def bench_job(storage: Path, size: Size, total_steps: int, standby_every_s: float | None = None) -> JobSpec:
    """The demo's job, longer, checkpointed every `size.every_s` seconds of training. threads 1: the demo's
    2 intra-op threads spin against each other and the replacement on a busy 2-core machine (4,000 steps
    took 130 s of training with 2 threads and 14 s with 1 at load average ~4)."""
    data = yaml.safe_load(DEMO_JOB.read_text())
    keep = data.get("checkpoint", {}).get("keep", 3)
    data.update(
        name="bench-recovery",
        storage=str(storage),
        total_steps=total_steps,
        threads=1,
        # copies to the warm standby (trainer/saving/peer.py) only reach one where B keeps one
        checkpoint={
            "every_steps": None,
            "every_seconds": size.every_s,
            "keep": keep,
            "standby_every_s": standby_every_s,
        },
        # the per-step times this benchmark reads stay in storage: with MLflow on, the tracker deletes
        # the metrics objects it holds (tasks/tracking/collect.py), and the timeline would lose them
        tracking={**(data.get("tracking") or {}), "mlflow": False},
    )
    return parse_spec(data, f"the benchmark's job (from {DEMO_JOB.name})")


def provider(
    size: Size, seed: int | None, fork_server: bool = True, *, warm: int = 0, no_notice: float = NO_NOTICE
) -> LocalProviderConfig:
    """Fresh-machine workers (no local cache kept between attempts); seed None: no reclaims;
    fork_server False: every trainer a fresh interpreter (run C, the cold start); warm: standby trainers
    (tasks/control/warm.py); no_notice: the share of reclaims without notice."""
    sim = (
        SpotSimulatorConfig()
        if seed is None
        else SpotSimulatorConfig(seed=seed, mean_interval_s=size.mean_s, no_notice_fraction=no_notice)
    )
    # a 30 s notice, GCP's and Azure's (AWS gives 120 s): the old worker trains through it until its
    # replacement stands by (trainer/preemption/handover.py); the SIGKILL comes at its end
    return LocalProviderConfig(
        keep_cache=False, simulator=sim, notice_s=NOTICE_S, fork_server=fork_server, warm=warm
    )


def planned(size: Size, seed: int, train_s: float, no_notice: float) -> list[PlannedPreemption]:
    """The simulator's reclaims for attempts 1.. while their seconds of training add up to `train_s`."""
    cfg = provider(size, seed, no_notice=no_notice).simulator
    plans: list[PlannedPreemption] = []
    while True:
        plan = plan_preemption(cfg, len(plans) + 1, simulator_rng(seed, len(plans) + 1))
        assert plan is not None
        if sum(p.after_s for p in plans) + plan.after_s >= train_s:
            return plans
        plans.append(plan)


def pick_seed(
    size: Size, train_s: float, start: int, no_notice: float
) -> tuple[int, list[PlannedPreemption]]:
    """The first seed from `start` whose draws within `train_s` are as many as expected (train_s / mean,
    rounded) and, two or more, of both kinds (where the share without notice allows both): a short run
    then rehearses a typical count and both paths."""
    want = round(train_s / size.mean_s)
    kinds = 2 if 0 < no_notice < 1 else 1
    for seed in range(start, start + MAX_SEEDS):
        plans = planned(size, seed, train_s, no_notice)
        if len(plans) == want and (want < 2 or len({p.notice for p in plans}) == kinds):
            return seed, plans
    return start, planned(size, start, train_s, no_notice)


# ---------------------------------------------------------------- reading a run


def step_s(run: FlowRun) -> float:
    """The mean time per ordinary step (checkpoint stalls included) over the surviving timeline: every
    gap between two steps except those before an attempt's first step."""
    order = sorted(run.steps)
    gaps = [run.steps[b].t - run.steps[a].t for a, b in itertools.pairwise(order) if not run.steps[b].first]
    return statistics.mean(gaps)


def start_split(run: FlowRun, a: Attempt, first_t: float | None) -> dict[str, float | None]:
    """An attempt's start-up, provision -> first step, at its `lease ... taken` line: before it the
    interpreter, imports, recipe build and data load (and a prewarmed trainer's wait for the lease);
    after it checkpoint selection, fetch, verification, restore and the first step."""
    lease = run.marks.get(a.worker_id, {}).get("lease_taken_t")
    if lease is None:
        return {"to_lease_s": None, "lease_to_first_step_s": None}
    return {"to_lease_s": lease - a.started_at, "lease_to_first_step_s": sub(first_t, lease)}


def phases(run: FlowRun) -> dict[str, Any]:
    """Flow call -> the first attempt's first step, -> the last step, -> flow return; the cold start (the
    first attempt's provision -> first step, storage empty); the pace of ordinary steps."""
    pace = step_s(run)
    t1, _ = first_step(run, run.attempts[0], pace)
    assert t1 is not None, f"{run.label}: the first attempt's first step is in neither metrics nor log"
    tn = run.steps[max(run.steps)].t
    return {
        "wall_s": run.wall_s,
        "startup_s": t1 - run.begin,
        "training_s": tn - t1,
        "finish_s": run.end - tn,
        "cold_start_s": t1 - run.attempts[0].started_at,
        "cold_split": start_split(run, run.attempts[0], t1),
        "step_ms": 1000 * pace,
        "steps": max(run.steps),
        "attempts": len(run.attempts),
    }


def at_pace(p: dict[str, Any], step_ms: float) -> float:
    """An uninterrupted run's wall with its training priced at another run's pace (ms per ordinary step):
    the machine is shared, and the same job's pace moved from 3.9 to 5.7 ms/step between two runs."""
    return p["startup_s"] + p["training_s"] * step_ms / p["step_ms"] + p["finish_s"]


def first_step(run: FlowRun, a: Attempt, per_step_s: float) -> tuple[float | None, str]:
    """When attempt `a` took its first step, and from what: its surviving metrics entry (exact), else
    its first forwarded `step N/M` line less N - first steps at the run's pace (within log_every steps)."""
    resumed = a.resumed_from or 0
    s = run.steps.get(resumed + 1)
    if s is not None and s.first and a.started_at <= s.t <= a.ended_at:
        return s.t, "metrics"
    marks = run.marks.get(a.worker_id, {})
    if "first_step_t" in marks:
        return marks["first_step_t"] - (marks["first_step"] - resumed - 1) * per_step_s, "log line"
    return None, "unknown"


def reclaims(run: FlowRun) -> list[dict[str, Any]]:
    """Per reclaimed attempt: what the simulator did, when the replacement trained again, and where the
    time from the anchor (the old worker's last step with a notice; without one, the newest step that
    survived or the old attempt's first step, whichever is later) to the replacement's first step went.
    The costs add up to the interrupted run's gaps in its surviving timeline."""
    out = []
    by_worker = {r.worker_id: r for r in run.reclaims}
    pace = step_s(run)
    for old, new in itertools.pairwise(run.attempts):
        sim = by_worker.get(old.worker_id)
        resumed = new.resumed_from or 0
        before = run.steps.get(resumed)  # the newest step that survived the reclaim
        old_first, _ = first_step(run, old, pace)
        new_first, source = first_step(run, new, pace)
        row: dict[str, Any] = {
            "attempt": old.n,
            "outcome": old.outcome,
            "cause": old.cause,
            "notice": sim.notice if sim else None,
            "after_s": sim.after_s if sim else None,
            "resumed_from": resumed,
            "last_step": old.last_step,
            "lost_steps": old.lost_steps,
            "prewarmed": new.started_at < old.ended_at,
            "first_step_from": source,
            "recovery_s": new_first - old.ended_at if new_first is not None else None,  # death seen -> step
            "start_split": start_split(run, new, new_first),
        }
        if sim is not None and sim.notice and before is not None and resumed == old.last_step:
            row |= {
                "cost_s": sub(new_first, before.t),
                "recovery_with_notice_s": sub(new_first, before.t),
                "notice_to_last_step_s": before.t - sim.at,  # the stop at the next step boundary
                "last_step_to_gone_s": old.ended_at
                - before.t,  # emergency checkpoint, exit, seen by the flow
                "gone_to_first_step_s": row["recovery_s"],  # lease handed over, restore (< 0: before it)
                "prewarm_lead_s": old.ended_at - new.started_at,  # the replacement's head start
            }
        elif sim is not None:
            anchor = max(t for t in (before.t if before else None, old_first) if t is not None)
            row |= {
                "cost_s": sub(new_first, anchor),
                "lost_s": sim.at - anchor,  # trained since the anchor, trained again
                "kill_to_seen_s": old.ended_at - sim.at,
                "flow_s": new.started_at - old.ended_at,  # check, record, decide, events, provision
                "flow_tasks_s": tasks_within(run, old.ended_at, new.started_at),
                "start_to_first_step_s": sub(new_first, new.started_at),
            }
        out.append(row)
    return out


def sub(a: float | None, b: float) -> float | None:
    return None if a is None else a - b


def tasks_within(run: FlowRun, t0: float, t1: float) -> dict[str, float]:
    """Seconds each task (by name) ran inside [t0, t1]."""
    parts: dict[str, float] = {}
    for name, a, b in run.tasks:
        inside = min(b, t1) - max(a, t0)
        if inside > 0.0005:
            parts[name] = parts.get(name, 0.0) + inside
    return parts


def overhead(run: FlowRun) -> list[dict[str, Any]]:
    """Per attempt: the time before its trainer process started that no trainer of the job was alive
    (flow start, or the last trainer's exit seen); a prewarmed trainer started before the old one was gone."""
    rows, prev = [], run.begin
    for a in run.attempts:
        rows.append({"attempt": a.n, "gap_s": a.started_at - prev, "prewarmed": a.started_at < prev})
        prev = a.ended_at
    return rows


def median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


# ---------------------------------------------------------------- reporting


def verdict(ok: bool) -> str:
    return "OK" if ok else "MISSED"


def fmt(x: float | None, unit: str = "s") -> str:
    return "-" if x is None else f"{x:.2f}{unit}"


def report_run(run: FlowRun, p: dict[str, Any]) -> None:
    outcomes = ", ".join(a.outcome for a in run.attempts)
    cs = p["cold_split"]
    say(
        f"[{run.label}] flow {run.state} in {p['wall_s']:.1f}s: call -> first step {p['startup_s']:.2f}s "
        f"(cold start: provision -> first step {p['cold_start_s']:.2f}s, lease taken at "
        f"{fmt(cs['to_lease_s'])}), training {p['training_s']:.1f}s "
        f"at {p['step_ms']:.2f} ms/step, last step -> return {p['finish_s']:.2f}s; attempts: {outcomes}"
    )


def report_reclaim(r: dict[str, Any]) -> None:
    kind = {True: "notice", False: "no notice", None: "not the simulator"}[r["notice"]]
    head = f"    attempt {r['attempt']} reclaimed ({kind}) after {fmt(r['after_s'])} of training:"
    src = "" if r["first_step_from"] == "metrics" else f" [first step from its {r['first_step_from']}]"
    if "recovery_with_notice_s" in r:
        say(
            f"{head} last step {r['last_step']} -> replacement's first step {fmt(r['cost_s'])}{src} = "
            f"emergency checkpoint + exit, seen {fmt(r['last_step_to_gone_s'])} + gone -> first step "
            f"{fmt(r['gone_to_first_step_s'])}; notice -> last step {fmt(r['notice_to_last_step_s'])}; "
            f"the replacement started {fmt(r['prewarm_lead_s'])} before the old worker was gone{split(r)}"
        )
    elif "lost_s" in r:
        tasks = ", ".join(f"{k} {v:.2f}" for k, v in sorted(r["flow_tasks_s"].items(), key=lambda kv: -kv[1]))
        say(
            f"{head} {fmt(r['cost_s'])}{src} = training lost {fmt(r['lost_s'])} ({r['lost_steps']} steps) + "
            f"kill -> seen {fmt(r['kill_to_seen_s'])} + flow {fmt(r['flow_s'])} ({tasks or 'no task'}) + "
            f"provision -> first step {fmt(r['start_to_first_step_s'])}{split(r)}"
        )
    else:
        say(f"{head} {r['cause']}; not broken down")


def split(r: dict[str, Any]) -> str:
    sp = r["start_split"]
    return (
        f"; its provision -> lease taken {fmt(sp['to_lease_s'])} (interpreter, imports, build, data), "
        f"-> first step {fmt(sp['lease_to_first_step_s'])} (checkpoint select, fetch, verify, restore)"
    )


def account(base: dict[str, float], b: dict[str, Any], rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Where the interrupted run's extra wall time went, against the uninterrupted baseline. The reclaims'
    costs add up to the gaps in the surviving timeline; each gap also holds one ordinary step."""
    costs = [r["cost_s"] for r in rows if r.get("cost_s") is not None]
    reclaims_s = sum(costs) - len(costs) * b["step_ms"] / 1000
    kinds = {"notice": [True], "no_notice": [False]}
    by_kind = {
        k: [r["cost_s"] for r in rows if r["notice"] in v and r.get("cost_s") is not None]
        for k, v in kinds.items()
    }
    lost = [r["lost_s"] for r in rows if "lost_s" in r]
    return {
        "extra_s": b["wall_s"] - base["wall_s"],
        "reclaims_s": reclaims_s,
        "notice_s": sum(by_kind["notice"]),
        "notice_n": len(by_kind["notice"]),
        "no_notice_s": sum(by_kind["no_notice"]),
        "no_notice_n": len(by_kind["no_notice"]),
        "lost_training_s": sum(lost),
        "startup_s": b["startup_s"] - base["startup_s"],
        "finish_s": b["finish_s"] - base["finish_s"],
        "pace_s": b["training_s"] - reclaims_s - base["training_s"],  # slower or faster ordinary steps
    }


def machine_load() -> str:
    return f"load average {os.getloadavg()[0]:.1f}"


# ---------------------------------------------------------------- driver


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt  # unwinds through every finally: trainers released, server stopped


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument(
        "--quick", action="store_true", help="~20 s of training, 10 s mean between reclaims, no A'"
    )
    ap.add_argument("--seed", type=int, default=0, help="the first seed tried for the trace (default 0)")
    ap.add_argument("--exact-seed", action="store_true", help="use --seed as is, whatever it draws")
    ap.add_argument(
        "--no-notice-fraction",
        type=float,
        default=NO_NOTICE,
        help=f"share of reclaims without notice (default {NO_NOTICE:.2f}; 1.0: every reclaim a SIGKILL)",
    )
    ap.add_argument("--warm", type=int, default=1, choices=(0, 1), help="B's standby workers (default 1)")
    ap.add_argument(
        "--standby-every-s",
        type=float,
        default=STANDBY_EVERY_S,
        help=f"with a standby, send it a state copy this often (default {STANDBY_EVERY_S:g}; 0: never)",
    )
    args = ap.parse_args()
    if not 0 <= args.no_notice_fraction <= 1:
        ap.error("--no-notice-fraction is a share: between 0 and 1")
    size = QUICK if args.quick else DEFAULT
    signal.signal(signal.SIGTERM, _interrupt)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # also when started in the background
    t0 = time.perf_counter()
    say(
        f"recovery benchmark: {os.cpu_count()} CPUs, {machine_load()}; {DEMO_JOB.name} at {size.total_steps} "
        f"steps, threads 1, a checkpoint every {size.every_s:g}s of training"
    )
    runs: list[FlowRun] = []
    with tempfile.TemporaryDirectory(prefix="spotrun-bench-recovery-") as tmp_name:
        tmp = Path(tmp_name)
        started = time.perf_counter()
        with prefect_server(tmp / "prefect") as server:
            say(f"Prefect server on {server.api_url} healthy after {time.perf_counter() - started:.1f}s")

            def run(
                label: str, seed: int | None, steps: int = size.total_steps, fork: bool = True, warm: int = 0
            ) -> FlowRun:
                root = tmp / label.split()[0]
                job = bench_job(root / "store", size, steps, args.standby_every_s or None)
                cfg = provider(size, seed, fork, warm=warm, no_notice=args.no_notice_fraction)
                return run_flow(server, root, label, job=job, cfg=cfg)

            def timed(label: str, seed: int | None, warm: int = 0) -> FlowRun:
                r = run(label, seed, warm=warm)
                runs.append(r)
                report_run(r, phases(r))
                return r

            w = run("warm-up", None, WARM_UP_STEPS)
            say(f"[warm-up] {w.wall_s:.1f}s, not counted: a process's first flow run pays one-time costs")
            c = run("C cold", None, WARM_UP_STEPS, fork=False)
            cold_s = phases(c)["cold_start_s"]
            say(
                f"[C cold start] a fresh `python -m spotrun.trainer` (fork server off): provision -> "
                "first step "
                f"{cold_s:.2f}s; what a restart without spotrun's fork server and prewarm pays"
            )
            a = timed("A uninterrupted", None, warm=args.warm)  # B's setup: its standby and copies too
            train_s = phases(a)["training_s"]
            seed, plans = (
                (args.seed, planned(size, args.seed, train_s, args.no_notice_fraction))
                if args.exact_seed
                else pick_seed(size, train_s, args.seed, args.no_notice_fraction)
            )
            drawn = ", ".join(f"{p.after_s:.1f}s{'' if p.notice else ' without notice'}" for p in plans)
            say(
                f"trace: seed {seed}, a mean of {size.mean_s:g}s of training between reclaims, "
                f"{args.no_notice_fraction:.0%} without notice; within {train_s:.0f}s of training it "
                f"reclaims after {drawn or 'nothing'}"
            )
            b = timed(f"B interrupted, warm {args.warm}", seed, warm=args.warm)
            rows = reclaims(b)
            for r in rows:
                report_reclaim(r)
            if size.baselines > 1:
                timed("A' uninterrupted", None, warm=args.warm)
            plain: dict[str, Any] | None = None
            if args.warm:  # what the standby and its copies cost the pace of ordinary steps
                e = run("E uninterrupted, warm 0", None)
                plain = phases(e)
                report_run(e, plain)
            cold_rows: list[dict[str, Any]] = []
            if args.warm and any(not p.notice for p in plans):  # the same trace without a standby
                d = run("D interrupted, warm 0", seed)
                report_run(d, phases(d))
                cold_rows = reclaims(d)
                for r in cold_rows:
                    report_reclaim(r)
    say(f"{machine_load()}")
    summary, detail = summarize(runs, rows, seed, cold_s)
    summary |= no_notice_summary(rows, cold_rows, warm=args.warm, fraction=args.no_notice_fraction)
    summary["standby_every_s"] = args.standby_every_s if args.warm else None
    if plain is not None:  # A's (and A''s) ms per step with the standby over E's without one, less 1
        with_standby = statistics.mean(phases(r)["step_ms"] for r in runs if r.label.startswith("A"))
        summary["standby_pace_cost"] = round(with_standby / plain["step_ms"] - 1, 3)
    wall = time.perf_counter() - t0
    OUT.parent.mkdir(parents=True, exist_ok=True)
    detail |= {"wall_s": wall, "quick": args.quick, "size": asdict(size)}
    OUT.write_text(json.dumps(detail, indent=2, default=str))
    say(f"wall {wall:.0f}s; details in {OUT}")
    print(json.dumps(summary), flush=True)


def no_notice_summary(
    rows: list[dict[str, Any]], cold_rows: list[dict[str, Any]], *, warm: int, fraction: float
) -> dict[str, Any]:
    """Recovery from reclaims without notice (death seen -> first resumed step, median) in B, with its
    standby, and in D, the same trace without one (the cold start a standby saves)."""

    def recovery(rs: list[dict[str, Any]]) -> float | None:
        m = median([r["recovery_s"] for r in rs if r["notice"] is False and r["recovery_s"] is not None])
        return round(m, 2) if m is not None else None

    warm_s, cold_s = recovery(rows), recovery(cold_rows)
    ok = warm_s is not None and warm_s <= GOAL_NO_NOTICE_S
    say(
        f"recovery without notice (death seen -> first resumed step), median: {fmt(warm_s)} with warm "
        f"{warm} {verdict(ok)} (<= {GOAL_NO_NOTICE_S:g}s), {fmt(cold_s)} without a standby (D)"
    )
    return {
        "recovery_no_notice_s": warm_s,
        "recovery_no_notice_cold_s": cold_s,
        "warm": warm,
        "no_notice_fraction": round(fraction, 3),
    }


def summarize(
    runs: list[FlowRun], rows: list[dict[str, Any]], seed: int, cold_process_s: float
) -> tuple[dict[str, Any], dict[str, Any]]:
    ps = [phases(r) for r in runs]
    b_run, b = runs[1], ps[1]
    bases = [p for r, p in zip(runs, ps, strict=True) if r is not b_run]
    base = {
        k: statistics.mean(p[k] for p in bases) for k in ("wall_s", "startup_s", "training_s", "finish_s")
    }
    raw = base["wall_s"] / b["wall_s"]
    matched = statistics.mean(at_pace(p, b["step_ms"]) for p in bases)
    goodput = matched / b["wall_s"]
    w = account(base, b, rows)
    paces = ", ".join(f"{r.label.split()[0]} {p['step_ms']:.2f}" for r, p in zip(runs, ps, strict=True))
    say(
        f"goodput = uninterrupted {matched:.1f}s (mean of {len(bases)}, its steps at B's pace) / interrupted "
        f"{b['wall_s']:.1f}s = {goodput:.1%} {verdict(goodput >= GOAL_GOODPUT)} (>= {GOAL_GOODPUT:.0%}); "
        f"as measured {base['wall_s']:.1f}s / {b['wall_s']:.1f}s = {raw:.1%} (ms per ordinary step: {paces})"
    )
    say(
        f"  the extra {w['extra_s']:.1f}s as measured: {len(rows)} reclaims {w['reclaims_s']:.1f}s "
        f"({w['notice_n']} with notice {w['notice_s']:.2f}s, {w['no_notice_n']} without "
        f"{w['no_notice_s']:.2f}s, of which training lost {w['lost_training_s']:.2f}s); start-up "
        f"{w['startup_s']:+.2f}s, finish {w['finish_s']:+.2f}s, ordinary steps {w['pace_s']:+.2f}s "
        "(the pace: machine load)"
    )
    forked = [p["cold_start_s"] for p in ps]  # each run's first attempt: forked, nothing to load
    recoveries = [r["recovery_s"] for r in rows if r["recovery_s"] is not None]
    rec, forked_s = median(recoveries), statistics.median(forked)
    ratio = rec / cold_process_s if rec is not None else None
    vs_forked = rec / forked_s if rec is not None else None
    with_notice = ", ".join(fmt(r["recovery_s"]) for r in rows if r["notice"]) or "-"
    without = ", ".join(fmt(r["recovery_s"]) for r in rows if r["notice"] is False) or "-"
    say(
        f"recovery (death seen -> first resumed step) median {fmt(rec)} / cold start of the trainer (C: "
        f"a fresh process, provision -> first step) {cold_process_s:.2f}s = {fmt(ratio, 'x')} "
        f"{verdict(ratio is not None and ratio <= GOAL_RATIO)} (<= {GOAL_RATIO:g}x); with notice "
        f"{with_notice}, without {without}; against the runs' forked first starts (median "
        f"{forked_s:.2f}s, nothing to load): {fmt(vs_forked, 'x')}"
    )
    notice = [r["recovery_with_notice_s"] for r in rows if r.get("recovery_with_notice_s") is not None]
    say(
        f"recovery with notice (old worker's last step -> replacement's first step): median "
        f"{fmt(median(notice))} ({', '.join(fmt(x) for x in notice) or 'no reclaim with notice'})"
    )
    gaps = [o for r in runs for o in overhead(r)]
    cold_gaps = [o["gap_s"] for o in gaps if not o["prewarmed"]]
    over = median(cold_gaps)
    say(
        f"flow overhead per attempt started cold (flow start or last exit seen -> process start): median "
        f"{fmt(over)} ({', '.join(fmt(x) for x in cold_gaps)}) "
        f"{verdict(over is not None and over <= GOAL_OVERHEAD_S)} (<= {GOAL_OVERHEAD_S:g}s); "
        f"{sum(o['prewarmed'] for o in gaps)} attempts prewarmed (started before the old worker was gone)"
    )
    m = median(notice)
    summary = {
        "goodput": round(goodput, 3),
        "goodput_as_measured": round(raw, 3),
        "recovery_ratio": round(ratio, 2) if ratio is not None else None,
        "recovery_vs_forked_start": round(vs_forked, 2) if vs_forked is not None else None,
        "recovery_with_notice_s": round(m, 2) if m is not None else None,
        "overhead_s": round(over, 2) if over is not None else None,
        "reclaims": len(rows),
        # goodput's parts, as measured in B: training lost to reclaims, and the rest of their cost (the
        # restarts: stop and save, detection, the flow, start-up)
        "lost_training_s": round(w["lost_training_s"], 2),
        "restart_s": round(w["reclaims_s"] - w["lost_training_s"], 2),
    }
    detail = {
        "summary": summary,
        "seed": seed,
        "baseline": base,
        "baseline_at_b_pace_s": matched,
        "accounting": w,
        "phases": ps,
        "reclaims": rows,
        "overhead": gaps,
        "cold_process_start_s": cold_process_s,
        "forked_starts_s": forked,
        "runs": [asdict(r) for r in runs],
    }
    return summary, detail


if __name__ == "__main__":
    main()
