"""A job with a deadline through the real flow and trainer, on a replayed capacity trace: the market
policy waits out an outage (no attempt row for the wait), starts on spot when the zone has capacity,
the zone's drop reclaims the worker with notice, the policy waits again and the job completes, ending
bitwise equal to an uninterrupted run, with every attempt's market and reason in SQL."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from spotrun.tasks.providers.local import LocalProviderConfig
from spotrun.trainer.checkpoint.format import step_dir
from tests.e2e.test_flow import attempts, job, reference_dir, run_flow
from tests.trainer_runs import assert_states_equal

pytestmark = pytest.mark.slow

# 0.5 s ticks: no spot for 2 s, spot for 1 s, none for 4 s, then spot
CAPACITY = [0] * 4 + [1] * 2 + [0] * 8 + [1] * 400


def test_a_dated_job_waits_out_outages_and_completes_bitwise(
    prefect_api: str, home: Path, tmp_path: Path
) -> None:
    trace = tmp_path / "us-test-1a_v100_1.json"
    trace.write_text(json.dumps({"metadata": {"gap_seconds": 1}, "data": CAPACITY}))
    # 2,000 steps (4 s at the fastest, 2 ms a step on a quiet machine) do not fit the first 1 s of
    # capacity with the start (a reclaim before the first step is a reclaim too); 20 minutes leave a
    # slack far above the policy's reserve of four starts (a start is assumed to cost 120 s before one
    # is measured), so it waits for spot rather than renting on-demand
    spec = job(tmp_path, total_steps=2000, deadline="20m", seconds_per_step=0.005)
    # no prewarm: a noticed trainer then saves and stops at once (with a replacement coming it would
    # train on through the notice, and might finish the job before its reclaim)
    provider = LocalProviderConfig(
        trace=str(trace), compress=2, notice_s=10, heartbeat_timeout_s=60, prewarm=False
    )
    state = run_flow(spec, provider)
    assert state.is_completed(), state.message
    rows = attempts(home)
    assert [r.outcome.value for r in rows] == ["preempted", "completed"], [(r.outcome, r.cause) for r in rows]
    assert rows[0].extra["trace"]["zone"] == "us-test-1a", rows[0].extra  # the zone's drop reclaimed it
    assert rows[0].extra["trace"]["reclaimed_at_tick"] in range(6, 14) and "notice" in rows[0].cause
    assert [r.extra["market"] for r in rows] == ["spot", "spot"]
    assert rows[0].extra["waited_s"] >= 1.5 and "spot capacity is back" in rows[0].extra["market_reason"]
    assert rows[0].extra["cost"]["market"] == "spot" and rows[0].extra["cost"]["zone"] == "us-test-1a"
    assert_states_equal(Path(spec.storage) / step_dir(spec.total_steps), reference_dir(spec, tmp_path))


def test_a_job_put_on_on_demand_moves_back_to_spot_when_it_returns(
    prefect_api: str, home: Path, tmp_path: Path
) -> None:
    """Spot is short at the start and the slack (declared: 1.5 s a step) is down to the reserve, so the
    policy rents on-demand; on on-demand that slack holds the two starts a move costs, so the controller
    tries spot ahead each poll, and once the zone has capacity again the spot trainer stands by, takes
    over from the on-demand one's emergency checkpoint, and the job ends bitwise as if uninterrupted."""
    trace = tmp_path / "us-test-1a_v100_1.json"
    # no spot for the first second (the first launch is refused), then spot: the on-demand trainer is
    # moved while it trains (2,000 steps: 4-20 s here, whatever the fork server has warmed up)
    trace.write_text(json.dumps({"metadata": {"gap_seconds": 1}, "data": [0] * 2 + [1] * 400}))
    # 1,500 s of declared work and 30 minutes: slack 180 s after a 120 s start (reserve: 480 s), and
    # 300 s once on-demand runs (a move needs 240 s)
    spec = job(tmp_path, total_steps=2000, deadline="30m", seconds_per_step=0.75)
    provider = LocalProviderConfig(trace=str(trace), compress=2, notice_s=10, heartbeat_timeout_s=60)
    state = run_flow(spec, provider)
    assert state.is_completed(), state.message
    rows = attempts(home)
    assert [(r.outcome.value, r.extra["market"]) for r in rows] == [
        ("preempted", "on-demand"),
        ("completed", "spot"),
    ], [(r.outcome, r.cause, r.extra) for r in rows]
    assert rows[0].extra["market_move"] == "spot" and "moved to spot" in rows[0].cause
    assert "reserve" in rows[0].extra["market_reason"] and "2 restarts" in rows[1].extra["market_reason"]
    assert rows[0].lost_steps == 0  # the on-demand trainer's emergency checkpoint is where spot resumed
    assert all("deadline_at" in r.extra for r in rows)  # the prewarmed spot attempt's row too (the report)
    assert_states_equal(Path(spec.storage) / step_dir(spec.total_steps), reference_dir(spec, tmp_path))
