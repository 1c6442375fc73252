"""The deadline benchmark's end-to-end replay: one dated job through spotrun's control loop and real
trainers on a compressed stretch of a real capacity trace, and the simulation of the same job on the
same stretch, fed what the product measured; they agree when they ran the same markets in the same
order and both met the deadline.

    from bench.deadline_e2e import e2e_replay
    result = e2e_replay(trace_sets, out_dir)   # {"agrees": bool | None, ...}

The stretch is the first one in the given traces shaped like the story a deadline policy is for: no
spot for a while (8-15 ticks), then spot (15-30 ticks), then none for long (60+ ticks). Replayed with
each tick lasting TICK_S, the job (digits, measured first by a calibration run of the same job: its
step rate and start cost come from SQL, as in production) gets a deadline of its work plus four starts:
a slack of three starts, so spotrun's policy rents on-demand in the first outage (its reserve is four),
moves back to spot once spot is back (on-demand, the slack holds the two starts a move costs), and
takes on-demand again at the drop. Each threshold is a start away from where the job stands, so a
start that takes a second more or less than measured changes no decision.

The control loop runs with a plain sink (no Prefect server): the flow adds task runs and events around
the same loop (tests/e2e/test_deadline_replay.py runs the same story through the flow and checks the
final state bitwise).
"""

from __future__ import annotations

import json
import math
import tempfile
import time
from itertools import groupby
from pathlib import Path
from typing import Any

from spotrun.tasks.control.loop import PlainSink, run_job
from spotrun.tasks.deadlines.plan import measure
from spotrun.tasks.deadlines.policy import POLICIES
from spotrun.tasks.deadlines.simulate import Job, simulate
from spotrun.tasks.decisions.policy import RetryPolicy
from spotrun.tasks.history import HistoryStore
from spotrun.tasks.market.traces import Trace
from spotrun.tasks.providers.local import LocalProviderConfig
from spotrun.tasks.providers.registry import build_provider
from spotrun.tasks.settings import Settings
from spotrun.trainer.spec.job import JobSpec

TICK_S = 0.75  # wall seconds a trace tick lasts in the replay
WORK_S = 35.0  # the dated job's work, in seconds at the measured step rate
SPOT_PER_H, ON_DEMAND_PER_H = 0.918, 3.06


def find_stretch(sets: dict[str, list[Trace]]) -> tuple[str, Trace, int] | None:
    """(name, one zone's trace, the tick the stretch starts at): outage, spot, long outage."""
    for name, zones in sets.items():
        if len(zones) != 1:
            continue
        t = zones[0]
        runs: list[tuple[bool, int, int]] = []
        i = 0
        for up, g in groupby(t.at(k) > 0 for k in range(len(t))):
            n = len(list(g))
            runs.append((up, i, n))
            i += n
        for (up0, at, a), (_, _, b), (_, _, c) in zip(runs, runs[1:], runs[2:], strict=False):
            if not up0 and 8 <= a <= 15 and 15 <= b <= 30 and c >= 60:
                return name, t, at
    return None


def _spec(name: str, storage: Path, total_steps: int, deadline: str | None = None) -> JobSpec:
    spec: dict[str, Any] = {
        "name": name,
        "recipe": "digits",
        "args": {"hidden": 128},
        "total_steps": total_steps,
        "threads": 1,
        "seed": 5,
        "checkpoint": {"every_steps": 250, "keep": 3},
        "storage": str(storage),
        "log_every": 500,
        "tracking": {"mlflow": False},
        "deadline": deadline,
    }
    return JobSpec.model_validate(spec)


def _markets(seq: list[str]) -> list[str]:
    return [m for m, _ in groupby(m for m in seq if m != "wait")]


def e2e_replay(sets: dict[str, list[Trace]], out: Path) -> dict[str, Any]:
    """Run the replay and its simulation; what each did, and whether they agree (None: no stretch)."""
    found = find_stretch(sets)
    if found is None:
        return {"agrees": None, "why": "no stretch shaped outage / spot / long outage in the traces"}
    name, trace, start = found
    stretch = trace.window(start, 400)
    with tempfile.TemporaryDirectory(prefix="spotrun-deadline-e2e-") as tmp:
        root = Path(tmp)
        settings = Settings(root / "home", f"sqlite:///{root / 'history.db'}")
        sleep = time.sleep

        def run(spec: JobSpec, cfg: LocalProviderConfig) -> Any:
            provider = build_provider(cfg, root / "workers", "")
            return run_job(spec, provider, RetryPolicy(), PlainSink(), settings=settings, sleep=sleep)

        # a fresh interpreter per worker (no fork server): a start then costs what a cold one does here
        # (1-3 s), comparable to a tick, as a cloud start is to a real trace's 32-195 s ticks
        calibration = run(_spec("dated", root / "calibration", 3000), LocalProviderConfig(fork_server=False))
        if not calibration.completed:
            return {"agrees": None, "why": f"calibration run failed: {calibration.message}"}
        store = HistoryStore.open(settings.database_url)
        try:
            m = measure(_spec("dated", root / "x", 1), store.attempts(job="dated"))
        finally:
            store.close()
        assert m.step_s is not None
        steps = int(WORK_S / m.step_s)
        deadline_s = float(math.ceil(steps * m.step_s + 4 * m.restart_s))
        dated = _spec("dated", root / "dated", steps, deadline=f"{deadline_s:.0f}s")
        path = root / f"{trace.zone}_v100_1.json"  # the replay's copy of the stretch, in the traces' format
        path.write_text(
            json.dumps({"metadata": {"gap_seconds": trace.gap_s}, "data": list(stretch.capacity)})
        )
        cfg = LocalProviderConfig(
            trace=str(path),
            compress=trace.gap_s / TICK_S,
            spot_price_per_h=SPOT_PER_H,
            on_demand_price_per_h=ON_DEMAND_PER_H,
            notice_s=10,
            fork_server=False,
        )
        t0 = time.monotonic()
        result = run(dated, cfg)
        wall = time.monotonic() - t0
        store = HistoryStore.open(settings.database_url)
        try:  # the dated run's attempts: the ones a market was chosen for
            rows = [r for r in store.attempts(job="dated") if r.extra.get("market")]
        finally:
            store.close()
    rows.sort(key=lambda r: r.attempt)
    due = rows[-1].extra.get("deadline_at") if rows else None
    met = result.completed and due is not None and rows[-1].ended_at <= float(due)
    product = _markets([str(r.extra.get("market", "spot")) for r in rows])
    product_cost = sum(float(r.extra.get("cost", {}).get("usd", 0.0)) for r in rows)
    sim_job = Job.of(
        work_s=steps * m.step_s,
        deadline_s=deadline_s,
        restart_s=m.restart_s,
        gap_s=TICK_S,
        spot_per_h=SPOT_PER_H,
        on_demand_per_h=ON_DEMAND_PER_H,
    )
    replayed = Trace(trace.zone, TICK_S, stretch.capacity)  # the same ticks, on the replay's clock
    sim = simulate(POLICIES["spotrun"], [replayed], sim_job, keep_spot=True)
    simulated = _markets([s.choice for s in sim.steps])
    detail = {
        "trace": name,
        "start_tick": start,
        "tick_s": TICK_S,
        "measured": {"step_s": m.step_s, "restart_s": m.restart_s},
        "steps": steps,
        "deadline_s": round(deadline_s, 1),
        "product": {
            "markets": product,
            "completed": result.completed,
            "met": met,
            "wall_s": round(wall, 1),
            "cost_usd": product_cost,
            "attempts": [
                (r.outcome.value, r.extra.get("market"), r.extra.get("market_reason")) for r in rows
            ],
        },
        "simulation": {
            "markets": simulated,
            "met": sim.met(sim_job),
            "cost_usd": sim.cost,
            "steps": [(s.tick, s.choice, s.reason) for s in sim.steps],
        },
    }
    agrees = product == simulated and met and sim.met(sim_job)
    detail["agrees"] = agrees
    detail["cost_ratio"] = round(product_cost / sim.cost, 3) if sim.cost else None
    out.mkdir(parents=True, exist_ok=True)
    (out / "e2e.json").write_text(json.dumps(detail, indent=1, default=str))
    return detail
