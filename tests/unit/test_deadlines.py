"""The deadline room's pure parts: each policy's decision in tables, the simulator's tick rules (no
capacity: no spot start; a drop: a reclaim; on-demand always there), the optimum against brute force
and against every policy, and traces refused in one line when malformed."""

from __future__ import annotations

import functools
import itertools
import json
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from spotrun.tasks.deadlines.optimum import optimum_cost
from spotrun.tasks.deadlines.policy import POLICIES, Decision, FixedRule, Situation, fixed
from spotrun.tasks.deadlines.simulate import Job, simulate
from spotrun.tasks.market.traces import Trace, load, load_file
from spotrun.trainer.errors import ConfigError

REPO = Path(__file__).resolve().parents[2]
TRACES = REPO / "tests" / "data" / "spot-traces"
H = 3600.0


def at(
    *,
    now: float = 0.0,
    deadline: float = 20 * H,
    work: float = 10 * H,
    done: float = 0.0,
    restart: float = 600.0,
    running: str | None = None,
    spot: bool = True,
    **more: Any,
) -> Situation:
    return Situation(
        now_s=now,
        deadline_s=deadline,
        work_s=work,
        done_s=done,
        restart_s=restart,
        running=running,  # type: ignore[arg-type]
        spot_available=spot,
        **more,
    )


# (policy, situation, choice). A 10 h job with a 20 h deadline and 600 s restarts unless it says.
DECISIONS = [
    ("on-demand", at(), "on-demand"),
    ("greedy", at(), "spot"),
    ("greedy", at(spot=False), "wait"),  # slack to spend
    ("greedy", at(now=9.9 * H, spot=False), "on-demand"),  # 0.1 h of slack: under the restart
    ("greedy", at(now=5 * H, done=5 * H, running="on-demand"), "on-demand"),  # never back to spot
    ("uniform-progress", at(spot=False), "wait"),  # on the line: not behind
    ("uniform-progress", at(now=4 * H, done=1 * H, spot=False), "on-demand"),  # behind the line (2 h)
    ("uniform-progress", at(now=4 * H, done=1 * H), "spot"),  # behind, but spot is there
    ("uniform-progress", at(now=4 * H, done=2.2 * H, running="on-demand"), "on-demand"),  # ahead < 2 restarts
    ("uniform-progress", at(now=4 * H, done=2.4 * H, running="on-demand"), "spot"),  # ahead >= 2 restarts
    ("uniform-progress", at(now=9.9 * H, done=0.0), "on-demand"),  # safety net: under 2 restarts of slack
    ("spotrun", at(spot=False), "wait"),
    ("spotrun", at(now=4 * H, done=1 * H, spot=False), "wait"),  # behind the line, but slack is plenty
    ("spotrun", at(now=9.6 * H, spot=False), "on-demand"),  # slack 0.23 h: under the 4-restart reserve
    ("spotrun", at(now=9.6 * H), "spot"),  # spot while there is any slack at all
    ("spotrun", at(now=9.9 * H), "on-demand"),  # slack spent
    ("spotrun", at(now=9.6 * H, done=0.0, running="on-demand"), "spot"),  # slack 0.4 h holds 2 restarts
    ("spotrun", at(now=9.8 * H, done=0.0, running="on-demand"), "on-demand"),  # 0.2 h: stays
    ("spotrun", at(now=9.6 * H, done=0.0, running="on-demand", spot=False), "on-demand"),
]


@pytest.mark.parametrize(("policy", "situation", "choice"), DECISIONS)
def test_each_policy_decides_as_its_rule_says(policy: str, situation: Situation, choice: str) -> None:
    decision = POLICIES[policy](situation)
    assert decision.choice == choice, decision.reason
    assert decision.reason and "\n" not in decision.reason


@pytest.mark.parametrize(
    ("rule", "situation", "choice"),
    [
        (FixedRule(after_preemptions=2), at(preemptions=1), "spot"),
        (FixedRule(after_preemptions=2), at(preemptions=2), "on-demand"),
        (FixedRule(after_s=600), at(spot=False, spot_short_s=599), "wait"),
        (FixedRule(after_s=600), at(spot=False, spot_short_s=600), "on-demand"),
        (FixedRule(after_s=600), at(running="on-demand"), "on-demand"),  # sticky
        (FixedRule(), at(spot=False, spot_short_s=1e9), "wait"),  # both rules off: spot only
    ],
)
def test_the_fixed_rules_are_a_policy(rule: FixedRule, situation: Situation, choice: str) -> None:
    assert fixed(rule)(situation).choice == choice


def job(work: int, deadline: int, restart: int = 1) -> Job:
    """A job in ticks of 1 s: spot costs 1 a tick, on-demand 3."""
    return Job(
        work_ticks=work,
        deadline_ticks=deadline,
        restart_ticks=restart,
        spot_per_tick=1.0,
        on_demand_per_tick=3.0,
        gap_s=1.0,
    )


def trace(caps: str, zone: str = "z") -> Trace:
    return Trace(zone, 1.0, tuple(int(c) for c in caps))


def test_no_capacity_means_no_spot_and_on_demand_is_always_there() -> None:
    j = job(work=4, deadline=12)
    run = simulate(POLICIES["spotrun"], [trace("0" * 40)], j)
    assert run.met(j) and run.spot_ticks == 0 and run.on_demand_ticks == 5  # restart + work
    assert run.cost == j.on_demand_cost
    assert [s.choice for s in run.steps] == ["wait", "on-demand"]  # waited while the slack allowed
    run = simulate(POLICIES["on-demand"], [trace("0" * 40)], j)
    assert (run.finished_tick, run.cost) == (5, 15.0)


def test_a_capacity_drop_reclaims_the_spot_worker_and_the_next_start_pays_a_restart() -> None:
    j = job(work=6, deadline=30)
    run = simulate(POLICIES["greedy"], [trace("1110011111111")], j)
    # spot 0-2 (restart, 2 work), reclaimed at 3, waits 3-4, spot again 5-9 (restart, 4 work)
    assert run.preemptions == 1 and run.finished_tick == 10 and run.spot_ticks == 8
    assert [(s.tick, s.choice) for s in run.steps] == [(0, "spot"), (3, "wait"), (5, "spot")]


def test_a_reclaimed_worker_moves_to_the_zone_that_has_capacity() -> None:
    j = job(work=5, deadline=30)
    run = simulate(POLICIES["greedy"], [trace("11000000", "a"), trace("11111111", "b")], j, start=0)
    assert run.met(j) and run.preemptions <= 1
    assert {s.zone for s in run.steps if s.choice == "spot"} <= {"a", "b"}


def brute_force(traces: list[Trace], j: Job) -> float:
    """Every sequence of choices (wait, on-demand, spot in a zone) tick by tick, under simulate's rules."""
    options = ["wait", "od", *range(len(traces))]
    best = float("inf")

    @functools.cache
    def go(tick: int, done: int, running: Any, overhead: int) -> float:
        if done >= j.work_ticks:
            return 0.0
        if tick >= j.deadline_ticks:
            return float("inf")
        if isinstance(running, int) and traces[running].at(tick) == 0:
            running, overhead = None, 0
        out = float("inf")
        for o in options:
            if isinstance(o, int) and traces[o].at(tick) == 0:
                continue
            if o == "wait":
                out = min(out, go(tick + 1, done, None, 0))
                continue
            price = j.on_demand_per_tick if o == "od" else j.spot_per_tick
            left = overhead if o == running else j.restart_ticks
            nxt = (left - 1, done) if left > 0 else (0, done + 1)
            out = min(out, price + go(tick + 1, nxt[1], o, nxt[0]))
        return out

    best = go(0, 0, None, 0)
    return best


@pytest.mark.parametrize("seed", range(12))
def test_the_optimum_is_the_brute_force_minimum_and_no_policy_beats_it(seed: int) -> None:
    rng = random.Random(seed)
    zones = [
        trace("".join(rng.choice("0111") for _ in range(14)), f"z{i}") for i in range(rng.choice((1, 2)))
    ]
    j = job(work=rng.randint(2, 5), deadline=rng.randint(7, 12), restart=rng.choice((0, 1, 2)))
    best = optimum_cost(zones, j)
    assert best == pytest.approx(brute_force(zones, j))
    for name, policy in POLICIES.items():
        run = simulate(policy, zones, j)
        if run.met(j):
            assert run.cost >= best - 1e-9, name


def test_every_policy_meets_the_deadline_on_the_real_traces() -> None:
    zones = load(TRACES / "us-east-2")
    gap = zones[0].gap_s
    for slack, start, name in itertools.product((1.1, 1.5, 2.0), (0, 1000, 2000), POLICIES):
        j = Job.of(
            work_s=4 * H,
            deadline_s=slack * (4 * H + 600),
            restart_s=600,
            gap_s=gap,
            spot_per_h=0.918,
            on_demand_per_h=3.06,
        )
        run = simulate(POLICIES[name], zones, j, start=start)
        assert run.met(j), (name, slack, start)
        assert optimum_cost(zones, j, start=start) <= run.cost + 1e-9


@pytest.mark.parametrize(
    ("body", "says"),
    [
        ("not json", "is not JSON"),
        ("[1, 2]", "expected"),
        ('{"metadata": {}, "data": [1]}', "gap_seconds must be a positive number"),
        ('{"metadata": {"gap_seconds": 0}, "data": [1]}', "gap_seconds must be a positive number"),
        ('{"metadata": {"gap_seconds": 60}, "data": []}', "non-empty list"),
        ('{"metadata": {"gap_seconds": 60}, "data": [1, -1]}', "data[1] is -1"),
        ('{"metadata": {"gap_seconds": 60}, "data": [1, true]}', "data[1] is True"),
    ],
)
def test_a_malformed_trace_is_refused_in_one_line(tmp_path: Path, body: str, says: str) -> None:
    path = tmp_path / "us-east-1a_v100_1.json"
    path.write_text(body)
    with pytest.raises(ConfigError) as e:
        load_file(path)
    assert says in str(e.value) and str(path) in str(e.value) and "\n" not in str(e.value)


def test_a_region_folder_and_its_zones(tmp_path: Path) -> None:
    zones = load(TRACES / "us-east-2")
    assert [z.zone for z in zones] == ["us-east-2a", "us-east-2b"] and len(zones[0]) == 3000
    assert [z.zone for z in load(TRACES / "us-east-2", zones=["us-east-2b"])] == ["us-east-2b"]
    with pytest.raises(ConfigError, match="has no zone us-west-1a; it has us-east-2a, us-east-2b"):
        load(TRACES / "us-east-2", zones=["us-west-1a"])
    assert zones[0].compressed(195).gap_s == 1.0 and zones[0].available() > 0.8
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    for name, gap in (("a1a_x.json", 60), ("a1b_x.json", 30)):
        (mixed / name).write_text(json.dumps({"metadata": {"gap_seconds": gap}, "data": [1]}))
    with pytest.raises(ConfigError, match="tick at different rates"):
        load(mixed)


def test_the_benchmark_runs_on_the_tests_traces_and_ends_with_its_json(tmp_path: Path) -> None:
    out = subprocess.run(
        [
            sys.executable,
            str(REPO / "bench" / "deadline.py"),
            "--traces",
            str(TRACES),
            "--slack",
            "1.1,2.0",
            "--starts",
            "2",
            "--work-h",
            "4",
            "--out",
            str(tmp_path),
            "--no-e2e",  # the replay through real trainers is the benchmark's, not the suite's
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    assert summary["traces"] == 1 and summary["cases"] == 4 and summary["deadlines_met"] == 4
    assert summary["e2e_agrees"] is None
    assert summary["cost_vs_optimum"] >= 1.0 and summary["cost_vs_on_demand"] < 1.0
    assert (tmp_path / "cost_vs_slack.png").stat().st_size > 0
    bad = subprocess.run(
        [sys.executable, str(REPO / "bench" / "deadline.py"), "--traces", str(TRACES), "--slack", "0.5"],
        capture_output=True,
        text=True,
    )
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "--slack below 1" in bad.stderr


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("12h", None),
        ("1h30m", None),
        ("2d", None),
        ("2026-12-07T08:00:00Z", None),
        ("2026-12-07T09:00:00+01:00", None),
        ("2026-12-07T08:00:00", "has no timezone"),
        ("tomorrow", "neither a time"),
        ("0h", "zero duration"),
    ],
)
def test_a_deadline_is_a_time_with_its_zone_or_a_duration(text: str, problem: str | None) -> None:
    from pydantic import ValidationError

    from spotrun.trainer.spec.deadline import deadline_at
    from spotrun.trainer.spec.job import JobSpec

    fields = {"name": "d", "recipe": "digits", "total_steps": 10, "deadline": text}
    if problem is None:
        JobSpec.model_validate(fields)
        if text == "1h30m":
            assert deadline_at(text, 1000.0) == 1000.0 + 5400
        if text.endswith("+01:00"):
            assert deadline_at(text, 0.0) == deadline_at("2026-12-07T08:00:00Z", 0.0)
    else:
        with pytest.raises(ValidationError, match=problem):
            JobSpec.model_validate(fields)


def test_as_deployed_a_running_spot_worker_is_not_asked() -> None:
    """As the controller asks the policy: at provisioning and while on-demand runs, never while spot does."""
    j = job(work=6, deadline=12)
    cap = [trace("00" + "1" * 30)]
    on_demand_first = simulate(POLICIES["spotrun"], cap, j, keep_spot=True)
    assert [s.choice for s in on_demand_first.steps] == [
        "wait",
        "on-demand",
        "spot",
    ]  # back to spot at tick 2

    def leave_spot(s: Situation) -> Decision:
        return Decision("on-demand" if s.running == "spot" else "spot", "test")

    asked = simulate(leave_spot, cap, job(work=6, deadline=20), start=2)
    kept = simulate(leave_spot, cap, job(work=6, deadline=20), start=2, keep_spot=True)
    assert [s.choice for s in asked.steps][:2] == ["spot", "on-demand"]
    assert [s.choice for s in kept.steps] == ["spot"] and kept.on_demand_ticks == 0
