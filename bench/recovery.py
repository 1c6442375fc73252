"""Recovery benchmark: how soon a job trains again after its worker dies, what the flow costs per
attempt, and the goodput that follows when a spot market takes the worker once a minute.

Measured in one run, with the local provider (each worker a `python -m trainer` subprocess):
  (a) recovery: a chain of attempts of one job, each killed by the spot simulator after a few
      seconds of training (alternately with and without notice). Recovery runs from the moment
      the death is observed (watch() returned) through the flow's own integrity check + estimate
      (tasks.checkpoints.validate_all, choose; no recipe is built), provision, and the resumed
      trainer's first `step` status line. Cold start: the same trainer with an empty storage,
      provision -> first `step`.
      Each cold start runs between a death and its recovery (the recovery clock starts after it),
      so both see the same machine. log_every: 1, so the first step is reported at once. Sizes:
      digits (kilobytes of state) and charlm with ~100 MB, where loading a checkpoint costs
      something. Replacement workers start with an empty cache (keep_cache: false), as a fresh
      spot machine does. Goal: median recovery / median cold start <= 1.5.
  (b) overhead: the real flow (flows.resilient_training) against a local Prefect server, on a tiny
      digits job preempted every 0.5 s of training. Per attempt: the time outside any trainer
      process's lifetime (flow start or a trainer's exit -> the next trainer's process start):
      watch return, release, validate, select, SQL record, decide, events, artifacts, provision.
      The run's finish (summary, timeline plot) is reported apart. Goal: median <= 2 s.
  (c) goodput: derived, not run (an hour of training does not fit a benchmark). A synthetic hour of
      reclaims drawn by the local simulator's own model and default mix (exponential, mean 60 s of
      training, 20 % without notice), priced with the costs measured above: downtime per
      preemption = recovery (a) + what the flow adds over the direct path (b's death -> next
      process gap less a's validate + select + provision); a notice adds the trainer's stop (notice
      -> process gone: emergency checkpoint, exit); no notice loses the training since the newest
      checkpoint durable at the kill, given a checkpoint every 10 s of training and the measured
      durability latency (step reached -> `durable` line). Also printed: other intervals and mixes,
      and the downtime that would reach the goal. Checkpoint stalls stay inside productive time, as
      in the product's own goodput (tasks/outcome.py); bench/checkpoint.py prices them. Goal >= 95 %.

Prints human-readable lines; the last line is one JSON object with the worst case over the sizes.
Details go to bench/out/recovery.json. Run from the repo root:
    .venv/bin/python bench/recovery.py [--quick]
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import os
import shutil
import signal
import statistics
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import yaml
from prefect import get_client
from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId
from prefect.events.worker import EventsWorker
from prefect.logging.handlers import APILogWorker
from prefect.settings import PREFECT_API_URL, PREFECT_HOME, temporary_settings

from flows.resilient_training import resilient_training
from spotrun.server import patched_environ
from tasks.checkpoints import choose, validate_all
from tasks.history import HistoryStore
from tasks.providers.base import WatchResult
from tasks.providers.local import (
    LocalProvider,
    LocalProviderConfig,
    PlannedPreemption,
    SpotSimulatorConfig,
    plan_preemption,
    simulator_rng,
)
from trainer.records import Record, Started, Step
from trainer.spec import JobSpec, parse_spec

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "bench" / "out" / "recovery.json"
GOAL_RATIO, GOAL_OVERHEAD_S, GOAL_GOODPUT = 1.5, 2.0, 0.95
PREEMPT_EVERY_S = 60.0  # mean seconds of training between reclaims in the synthetic trace
CHECKPOINT_EVERY_S = 10.0  # the synthetic trace's checkpoint interval (seconds of training)
NO_NOTICE = SpotSimulatorConfig().no_notice_fraction  # the simulator's default share of hard kills
CHECKPOINT_GRID_S = (2.0, 5.0, 10.0, 30.0)
TRACE_S = 3600.0
HOURS = 100  # synthetic hours averaged: one hour holds only ~55 draws of a 60 s mean


@dataclass(frozen=True)
class Case:
    label: str
    recipe: str
    args: dict[str, Any]
    batch_size: int
    every_steps: int  # checkpoint cadence in the chain
    train_s: float  # training per chain attempt before the simulator reclaims the worker
    reps: int  # cold starts and recoveries each


DIGITS = Case("digits", "digits", {"hidden": 256, "dropout": 0.1, "lr": 0.003}, 64, 20, 1.5, 5)
CHARLM = Case(
    "charlm-100MB", "charlm", {"d_model": 384, "n_layers": 5, "seq_len": 64, "dropout": 0.0}, 4, 5, 5.0, 3
)
FULL, QUICK = [DIGITS, CHARLM], [replace(DIGITS, reps=2)]


def say(msg: str) -> None:
    print(msg, flush=True)


def job_for(case: Case, storage: Path, **extra: Any) -> JobSpec:
    """threads 1: two intra-op threads on a busy 2-core machine spin against each other."""
    spec = {
        "name": f"bench-{case.label}", "recipe": case.recipe, "args": case.args, "total_steps": 100_000,
        "batch_size": case.batch_size, "threads": 1, "log_every": 1, "storage": str(storage),
        "checkpoint": {"every_steps": case.every_steps, "keep": 2}, **extra,
    }  # fmt: skip
    return parse_spec(spec, f"benchmark job {case.label}")


def write_job(job: JobSpec, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(job.model_dump(mode="json"), sort_keys=False))
    return path


# ---------------------------------------------------------------- (a) one attempt, timed


class _FirstStep(Exception):
    """Raised from the status callback to end a watch at the first training step."""


@dataclass
class Attempt:
    """One attempt's clock readings, epoch seconds (trainer status lines carry the trainer's own)."""

    begin: float  # the caller's clock start
    provisioned: float = 0.0  # provision() returned: the process exists
    started: float | None = None  # the `started` line (imports, build, checkpoint restore done)
    first_step: float | None = None  # the first `step` line
    watched: float | None = None  # watch() returned: the death is observed
    result: WatchResult | None = None

    def on_status(self, rec: Record, stop_at_first_step: bool) -> None:
        if isinstance(rec, Started):
            self.started = rec.t
        elif isinstance(rec, Step) and self.first_step is None:
            self.first_step = rec.t
            if stop_at_first_step:
                raise _FirstStep

    def phases(self) -> dict[str, float]:
        assert self.started is not None and self.first_step is not None, "the trainer never stepped"
        return {
            "total": self.first_step - self.begin,
            "provision": self.provisioned - self.begin,
            "to_started": self.started - self.provisioned,
            "to_first_step": self.first_step - self.started,
        }


def run_attempt(
    provider: LocalProvider, job: JobSpec, n: int, spec_path: Path, begin: float, stop_at_first_step: bool
) -> Attempt:
    """Provision attempt `n` and watch it until the first step (or until it dies); always release it."""
    a = Attempt(begin)
    worker = provider.provision(job, n, spec_path, [])
    a.provisioned = time.time()
    try:
        a.result = provider.watch(worker, lambda rec: a.on_status(rec, stop_at_first_step), None)
        a.watched = time.time()
    except _FirstStep:
        pass
    finally:
        provider.release(worker)
    if a.first_step is None:
        tail = a.result.log_tail[-2000:] if a.result else ""
        raise SystemExit(f"attempt {n} of {job.name} never reached a training step:\n{tail}")
    return a


def cold_start(provider: LocalProvider, job: JobSpec, spec_path: Path, n: int) -> dict[str, float]:
    """The same trainer with nothing to resume from: process start -> first step."""
    shutil.rmtree(job.storage, ignore_errors=True)
    return run_attempt(provider, job, n, spec_path, time.time(), stop_at_first_step=True).phases()


# ---------------------------------------------------------------- (a) the chain of deaths and recoveries


@dataclass
class Chain:
    """Attempts of one job, each reclaimed by the simulator and recovered the way the flow does it."""

    provider: LocalProvider
    job: JobSpec
    spec_path: Path
    flow_cache: Path
    attempts: list[Attempt] = field(default_factory=list)
    deaths: list[dict[str, Any]] = field(default_factory=list)

    @classmethod
    def build(cls, case: Case, root: Path) -> Chain:
        job = job_for(case, root / "store")
        plan = [PlannedPreemption(after_s=case.train_s, notice=i % 2 == 1) for i in range(case.reps + 1)]
        cfg = LocalProviderConfig(
            workdir=str(root / "work"), keep_cache=False, notice_s=30,
            simulator=SpotSimulatorConfig(schedule=plan),
        )  # fmt: skip
        chain = cls(LocalProvider(cfg), job, write_job(job, root / "job.yaml"), root / "flow-cache")
        validate_all(job, chain.flow_cache)  # warm up: the first integrity check imports the hashing paths
        return chain

    def first(self) -> None:
        """Attempt 1, from scratch, until the simulator reclaims it."""
        a = run_attempt(self.provider, self.job, 1, self.spec_path, time.time(), stop_at_first_step=False)
        self.attempts.append(a)

    def recover(self, last: bool) -> dict[str, Any]:
        """Validate + select + provision + the resumed trainer's first step, timed from now."""
        begin = time.time()
        point = choose(validate_all(self.job, self.flow_cache), self.job.storage)
        selected = time.time()
        self.deaths.append(death(self.attempts[-1], point.step))
        n = len(self.attempts) + 1
        a = run_attempt(self.provider, self.job, n, self.spec_path, begin, stop_at_first_step=last)
        self.attempts.append(a)
        resumed = a.result.resumed_from if a.result else point.step  # stopped early: no WatchResult
        return {**a.phases(), "validate_select": selected - begin, "provision": a.provisioned - selected,
                "resumed_from": point.step, "trainer_agreed": resumed == point.step}  # fmt: skip


def death(a: Attempt, resumed_step: int | None) -> dict[str, Any]:
    """How an attempt ended and what it cost: the stop after a notice, or the work since the newest
    durable checkpoint without one; and how long its checkpoints took to become durable."""
    r = a.result
    assert r is not None and a.watched is not None
    reached = dict((s, t) for t, s in r.step_times)
    noticed = r.notice_at if r.notice_at is not None else float("inf")
    latencies = [t - reached[s] for t, s in r.durable_times if s in reached and t < noticed]
    lost_from = reached.get(resumed_step or 0, r.started_training_at or r.ended_at)
    return {
        "notice": r.notice_at is not None,
        "stop_s": r.ended_at - r.notice_at if r.notice_at is not None else None,
        "stop_phases_s": stop_phases(r),
        "lost_steps": max(0, r.last_step - (resumed_step or 0)),
        "lost_s": max(0.0, (r.killed_at or r.ended_at) - lost_from) if r.notice_at is None else 0.0,
        "detect_s": a.watched - r.ended_at,
        "durable_latency_s": latencies,
    }


def stop_phases(r: WatchResult) -> dict[str, float]:
    """After a notice: when the trainer said `stopping`, its emergency checkpoint was durable, it wrote
    its `exit` line, and its process was gone, each counted from the one before."""
    if r.notice_at is None:
        return {}
    durable = [t for t, _ in r.durable_times if t >= r.notice_at]
    points = [("stopping", r.stopping.t if r.stopping else None), ("checkpoint", max(durable, default=None)),
              ("exit_line", r.exit.t if r.exit else None), ("gone", r.ended_at)]  # fmt: skip
    out, prev = {}, r.notice_at
    for name, t in points:
        if t is not None:
            out[name], prev = float(t) - prev, float(t)
    return out


def bench_case(case: Case, root: Path) -> dict[str, Any]:
    """Cold starts and recoveries of one job, interleaved."""
    chain = Chain.build(case, root / "chain")
    cold_job = job_for(case, root / "cold-store")
    cold_path = write_job(cold_job, root / "cold.yaml")
    cold_provider = LocalProvider(LocalProviderConfig(workdir=str(root / "cold-work"), keep_cache=False))
    chain.first()
    cold, recovery = [], []
    for i in range(case.reps):
        cold.append(cold_start(cold_provider, cold_job, cold_path, i + 1))
        recovery.append(chain.recover(last=i == case.reps - 1))
        c, r = cold[-1]["total"], recovery[-1]["total"]
        say(f"[{case.label}]   rep {i + 1}: cold start {c:.2f}s, recovery {r:.2f}s")
    ratio = med(recovery, "total") / med(cold, "total")
    return {"cold": cold, "recovery": recovery, "deaths": chain.deaths, "recovery_ratio": ratio}


def med(rows: list[dict[str, Any]], key: str) -> float:
    return statistics.median(float(r[key]) for r in rows if r.get(key) is not None)


# ---------------------------------------------------------------- (b) the real flow


def flow_job(root: Path, preemptions: int) -> tuple[JobSpec, LocalProviderConfig]:
    """A tiny digits job reclaimed every 0.5 s of training, alternately with and without notice."""
    job = job_for(
        DIGITS, root / "store", name="bench-flow", total_steps=100 * (preemptions + 1), log_every=20
    )
    plan = [PlannedPreemption(after_s=0.5, notice=i % 2 == 1) for i in range(preemptions)]
    cfg = LocalProviderConfig(keep_cache=False, notice_s=30, simulator=SpotSimulatorConfig(schedule=plan))
    return job, cfg


@contextmanager
def prefect_server(home: Path) -> Iterator[Any]:
    """A local Prefect server (SQLite) for the length of the block, stopped however the block ends."""
    from spotrun.server import PrefectServer

    server = PrefectServer(home)
    try:
        t0 = time.perf_counter()
        server.start()
        say(f"(b) Prefect server on {server.api_url} healthy after {time.perf_counter() - t0:.1f}s")
        yield server
    finally:
        # Prefect's log and event senders flush while the server still answers; left for exit, they
        # would retry against a closed port for minutes.
        APILogWorker.drain_all(timeout=10)
        EventsWorker.drain_all(timeout=10)
        server.stop()


def run_flow(root: Path, preemptions: int) -> dict[str, Any]:
    """One flow run against a local Prefect server; returns its wall time, attempts and task runs."""
    job, cfg = flow_job(root, preemptions)
    db = f"sqlite:///{root / 'history.db'}"
    env = {"SPOTRUN_HOME": str(root / "home"), "SPOTRUN_DATABASE_URL": db}
    with prefect_server(root / "prefect") as server, patched_environ(**env):
        api = {PREFECT_API_URL: server.api_url, PREFECT_HOME: str(server.home)}
        with temporary_settings(updates=api):
            for handler in logging.getLogger().handlers:  # run logs still go to the API; errors here
                handler.setLevel(logging.ERROR)
            begin = time.time()
            state = resilient_training(job=job, provider=cfg, return_state=True)
            end = time.time()
            tasks = task_runs(state.state_details.flow_run_id)
    with HistoryStore.open(db) as store:
        attempts = [(a.started_at, a.ended_at, a.outcome.value) for a in store.attempts(job=job.name)]
    return {"begin": begin, "end": end, "state": state.name, "message": state.message,
            "attempts": attempts, "tasks": tasks}  # fmt: skip


def task_runs(flow_run_id: Any) -> list[tuple[str, float, float]]:
    """(task name, start, end) of every task run of the flow run, as the server recorded them."""
    with get_client(sync_client=True) as client:
        runs = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))
    return [
        (r.name.rsplit("-", 1)[0], r.start_time.timestamp(), r.end_time.timestamp())
        for r in runs
        if r.start_time is not None and r.end_time is not None
    ]


def overhead(run: dict[str, Any]) -> dict[str, Any]:
    """Per attempt: the time before its trainer process started that no trainer was alive."""
    attempts, tasks = run["attempts"], run["tasks"]
    ends = [run["begin"]] + [e for _, e, _ in attempts[:-1]]
    gaps = [s - prev for (s, _, _), prev in zip(attempts, ends, strict=True)]
    lifetimes = sum(e - s for s, e, _ in attempts)
    wall = run["end"] - run["begin"]
    parts: dict[str, list[float]] = {}
    for (s, _, _), prev in zip(attempts[1:], ends[1:], strict=True):  # gaps between a death and a restart
        for name, t0, t1 in tasks:
            inside = max(0.0, min(t1, s) - max(t0, prev))
            parts.setdefault(name, []).append(inside)
    between = gaps[1:]
    return {
        "wall_s": wall, "trainer_lifetimes_s": lifetimes, "attempts": len(attempts),
        "outcomes": [o for _, _, o in attempts], "gaps_s": gaps, "overhead_s": statistics.median(gaps),
        "mean_all_s": (wall - lifetimes) / len(attempts), "finish_s": run["end"] - attempts[-1][1],
        "between_s": statistics.median(between) if between else None,
        "between_mean_s": statistics.mean(between) if between else None,
        "between_parts_s": {k: sum(v) / len(between) for k, v in parts.items()} if between else {},
        "state": run["state"], "message": run["message"],
    }  # fmt: skip


# ---------------------------------------------------------------- (c) synthetic hours


@dataclass(frozen=True)
class Costs:
    """What one preemption costs, measured in (a) and (b)."""

    cold_s: float  # the trace's first start
    downtime_s: float  # death observed -> first resumed step, flow included
    stop_s: float  # with notice: notice -> exit (the emergency checkpoint)
    durable_latency_s: float  # a checkpoint's step reached -> durable


def lost_training(after_s: float, every_s: float, latency_s: float) -> float:
    """Training since the newest checkpoint that was durable when the worker died (the one the attempt
    resumed from, at 0, always is)."""
    k = max(0, int((after_s - latency_s) // every_s))
    return after_s - k * every_s


Reclaims = tuple[tuple[tuple[float, bool], ...], ...]  # per synthetic hour: (seconds of training, notice)


@functools.cache
def reclaims(no_notice: float) -> Reclaims:
    """The reclaims the local simulator draws with seeds 0.. HOURS-1, enough for an hour of training each."""
    hours = []
    for seed in range(HOURS):
        sim = SpotSimulatorConfig(seed=seed, mean_interval_s=PREEMPT_EVERY_S, no_notice_fraction=no_notice)
        plans: list[tuple[float, bool]] = []
        while sum(after for after, _ in plans) < TRACE_S:
            plan = plan_preemption(sim, len(plans) + 1, simulator_rng(seed, len(plans) + 1))
            assert plan is not None
            plans.append((plan.after_s, plan.notice))
        hours.append(tuple(plans))
    return tuple(hours)


def synthetic_hour(c: Costs, every_s: float, plans: tuple[tuple[float, bool], ...]) -> tuple[float, ...]:
    """(productive s, wall s, preemptions, training lost s) of an hour of training interrupted by `plans`."""
    wall, productive, n, lost = c.cold_s, 0.0, 0, 0.0
    for after_s, notice in plans:
        if wall + after_s >= TRACE_S:  # the hour ends while it trains
            break
        gone = 0.0 if notice else lost_training(after_s, every_s, c.durable_latency_s)
        productive, n, lost = productive + after_s - gone, n + 1, lost + gone
        wall += after_s + c.downtime_s + (c.stop_s if notice else 0.0)
    productive += max(0.0, TRACE_S - wall)
    return productive, max(wall, TRACE_S), n, lost


def goodput(c: Costs, every_s: float, no_notice: float) -> dict[str, float]:
    """Productive / wall time, with preemptions and lost training per hour, over HOURS synthetic hours."""
    hours = [synthetic_hour(c, every_s, plans) for plans in reclaims(no_notice)]
    productive, wall, n, lost = (sum(h[i] for h in hours) for i in range(4))
    return {
        "goodput": productive / wall,
        "preemptions_per_hour": n / len(hours),
        "lost_s_per_hour": lost / len(hours),
    }


def downtime_budget(c: Costs, every_s: float, no_notice: float) -> float | None:
    """The largest downtime per preemption that still reaches the goodput goal; None: none does."""
    lo, hi = 0.0, PREEMPT_EVERY_S
    if goodput(replace(c, downtime_s=lo), every_s, no_notice)["goodput"] < GOAL_GOODPUT:
        return None
    for _ in range(16):
        mid = (lo + hi) / 2
        ok = goodput(replace(c, downtime_s=mid), every_s, no_notice)["goodput"] >= GOAL_GOODPUT
        lo, hi = (mid, hi) if ok else (lo, mid)
    return lo


def costs_for(case: dict[str, Any], flow_extra_s: float) -> Costs:
    deaths = case["deaths"]
    stops = [d["stop_s"] for d in deaths if d["notice"]]
    latencies = [x for d in deaths for x in d["durable_latency_s"]]
    return Costs(
        cold_s=med(case["cold"], "total"),
        downtime_s=med(case["recovery"], "total") + flow_extra_s,
        stop_s=statistics.median(stops) if stops else 0.0,
        durable_latency_s=statistics.median(latencies) if latencies else 0.0,
    )


def trace(case: dict[str, Any], flow_extra_s: float) -> dict[str, Any]:
    c = costs_for(case, flow_extra_s)
    grid = {
        every: {"goodput": goodput(c, every, NO_NOTICE)["goodput"],
                "downtime_budget_s": downtime_budget(c, every, NO_NOTICE)}
        for every in CHECKPOINT_GRID_S
    }  # fmt: skip
    mixes = {share: goodput(c, CHECKPOINT_EVERY_S, share)["goodput"] for share in (0.0, 0.5, 1.0)}
    return {"costs": c.__dict__, **goodput(c, CHECKPOINT_EVERY_S, NO_NOTICE),
            "by_checkpoint_every_s": grid, "by_no_notice_share": mixes}  # fmt: skip


# ---------------------------------------------------------------- reporting


def verdict(ok: bool) -> str:
    return "OK" if ok else "MISSED"


def report_case(label: str, r: dict[str, Any]) -> None:
    cold, rec = r["cold"], r["recovery"]
    ratio = r["recovery_ratio"]
    say(
        f"[{label}] (a) cold start (provision -> first step) median {med(cold, 'total'):.2f}s; recovery "
        f"(death observed -> first resumed step) median {med(rec, 'total'):.2f}s -> {ratio:.2f}x "
        f"{verdict(ratio <= GOAL_RATIO)} (<= {GOAL_RATIO}x)"
    )
    say(
        f"[{label}]     recovery = validate+select {med(rec, 'validate_select'):.2f}s + provision "
        f"{med(rec, 'provision'):.2f}s + trainer start -> `started` {med(rec, 'to_started'):.2f}s + first "
        f"step {med(rec, 'to_first_step'):.2f}s (medians); cold: provision {med(cold, 'provision'):.2f}s + "
        f"start -> `started` {med(cold, 'to_started'):.2f}s + first step {med(cold, 'to_first_step'):.2f}s"
    )
    agreed = all(x["trainer_agreed"] for x in rec)
    say(f"[{label}]     the trainer resumed from the checkpoint the flow's select chose: {agreed}")
    for d in r["deaths"]:
        lat = ", ".join(f"{x:.2f}" for x in d["durable_latency_s"][:4]) or "-"
        if d["notice"]:
            phases = ", ".join(f"{k} +{v:.2f}" for k, v in d["stop_phases_s"].items())
            how = f"notice -> gone in {d['stop_s']:.2f}s ({phases}), {d['lost_steps']} steps lost"
        else:
            how = f"no notice: lost {d['lost_s']:.2f}s of training ({d['lost_steps']} steps)"
        say(f"[{label}]     death, {how}; seen {d['detect_s']:.2f}s after exit; durable latency {lat}s")


def report_flow(o: dict[str, Any]) -> None:
    gaps = ", ".join(f"{g:.2f}" for g in o["gaps_s"])
    say(
        f"(b) flow run {o['state']}: {o['attempts']} attempts ({', '.join(o['outcomes'])}) in "
        f"{o['wall_s']:.1f}s, trainer processes alive {o['trainer_lifetimes_s']:.1f}s"
    )
    say(
        f"(b) per attempt outside any trainer: median {o['overhead_s']:.2f}s ({gaps}) "
        f"{verdict(o['overhead_s'] <= GOAL_OVERHEAD_S)} (<= {GOAL_OVERHEAD_S:.0f}s); run finish (summary, "
        f"timeline plot) {o['finish_s']:.2f}s; all of it over attempts {o['mean_all_s']:.2f}s"
    )
    if o["between_s"] is not None:
        parts = o["between_parts_s"]
        named = ", ".join(
            f"{k} {v:.2f}" for k, v in sorted(parts.items(), key=lambda kv: -kv[1]) if v > 0.005
        )
        rest = o["between_mean_s"] - sum(parts.values())
        say(
            f"(b) death -> next process: median {o['between_s']:.2f}s, mean {o['between_mean_s']:.2f}s = "
            f"in tasks {named}; outside tasks (SQL record, decide, events, artifacts, task-run "
            f"bookkeeping) {rest:.2f}s"
        )


def report_trace(label: str, t: dict[str, Any], extra_s: float) -> None:
    c, g = t["costs"], t["goodput"]
    say(
        f"[{label}] (c) per preemption: downtime {c['downtime_s']:.2f}s (recovery + {extra_s:.2f}s the flow "
        f"adds), +{c['stop_s']:.2f}s stop with notice, durable latency {c['durable_latency_s']:.2f}s"
    )
    say(
        f"[{label}]     {HOURS} synthetic hours: {t['preemptions_per_hour']:.0f} preemptions and "
        f"{t['lost_s_per_hour']:.0f}s of training lost per hour; goodput {g:.1%} "
        f"{verdict(g >= GOAL_GOODPUT)} (>= {GOAL_GOODPUT:.0%})"
    )
    grid = ", ".join(
        f"{k:g}s {v['goodput']:.1%} ({budget(v['downtime_budget_s'])})"
        for k, v in t["by_checkpoint_every_s"].items()
    )
    say(f"[{label}]     checkpoint every {grid}")
    mixes = ", ".join(f"{k:.0%} {v:.1%}" for k, v in t["by_no_notice_share"].items())
    say(f"[{label}]     share without notice (checkpoint every {CHECKPOINT_EVERY_S:g}s): {mixes}")


def budget(s: float | None) -> str:
    goal = f"{GOAL_GOODPUT:.0%}"
    return f"{goal} out of reach even with no downtime" if s is None else f"{goal} needs downtime <= {s:.1f}s"


def machine_load() -> str:
    return f"load average {os.getloadavg()[0]:.1f}"


# ---------------------------------------------------------------- driver


def derive_goodput(cases: dict[str, Any], flow: dict[str, Any]) -> tuple[float, dict[str, Any]]:
    """(c) for each size. The flow's cost over the direct path: its median death -> next process gap
    less the direct validate + select + provision of the same digits job."""
    rec = cases[DIGITS.label]["recovery"]
    extra = max(
        0.0, (flow["between_s"] or flow["overhead_s"]) - med(rec, "validate_select") - med(rec, "provision")
    )
    say(
        f"(c) synthetic hours, derived from the costs above (not run): reclaims every {PREEMPT_EVERY_S:.0f}s "
        f"of training on average, {NO_NOTICE:.0%} without notice (the local simulator's model and default "
        f"mix); checkpoint every {CHECKPOINT_EVERY_S:g}s of training"
    )
    traces = {label: trace(c, extra) for label, c in cases.items()}
    for label, t in traces.items():
        report_trace(label, t, extra)
    return extra, traces


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt  # unwinds through every finally: trainers released, server stopped


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="digits only, 2 reps, 2 flow attempts: a smoke run")
    quick = ap.parse_args().quick
    signal.signal(signal.SIGTERM, _interrupt)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # also when started in the background
    t0 = time.perf_counter()
    say(f"recovery benchmark: {os.cpu_count()} CPUs, {machine_load()}")
    cases: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="spotrun-bench-recovery-") as tmp:
        for case in QUICK if quick else FULL:
            say(f"[{case.label}] {case.recipe} {case.args}: {case.reps} cold starts and recoveries")
            cases[case.label] = bench_case(case, Path(tmp) / case.label)
            report_case(case.label, cases[case.label])
        flow = overhead(run_flow(Path(tmp) / "flow", preemptions=1 if quick else 5))
    report_flow(flow)
    extra, traces = derive_goodput(cases, flow)
    summary = {
        "recovery_ratio": round(max(c["recovery_ratio"] for c in cases.values()), 2),
        "overhead_s": round(flow["overhead_s"], 2),
        "goodput": round(min(t["goodput"] for t in traces.values()), 3),
    }
    wall = time.perf_counter() - t0
    OUT.parent.mkdir(parents=True, exist_ok=True)
    detail = {"summary": summary, "cases": cases, "flow": flow, "flow_extra_s": extra, "traces": traces,
              "wall_s": wall, "quick": quick}  # fmt: skip
    OUT.write_text(json.dumps(detail, indent=2, default=str))
    say(f"wall {wall:.0f}s; {machine_load()}; details in {OUT}")
    print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
