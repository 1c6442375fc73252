"""The market decision at each provisioning, for a job with a deadline or a max_wait_s: what SQL
measured of the job, the refusal at submission with its numbers, and the control loop's choice (spot,
on-demand, or wait out an outage) recorded on the attempt row, on a fake clock and scripted providers."""

from __future__ import annotations

import random
import time
from pathlib import Path
from typing import Any

import pytest

from spotrun.tasks.control.loop import PlainSink, run_job
from spotrun.tasks.control.market import DEADLINE_AT_RISK, MARKET_CHOSEN, BackToSpot, MarketChooser
from spotrun.tasks.control.prewarm import Prewarm
from spotrun.tasks.deadlines.plan import DEFAULT_RESTART_S, measure, submission_problem
from spotrun.tasks.decisions.attempts import MARKET_MOVE, AttemptRecord, Outcome
from spotrun.tasks.decisions.outcome import classify
from spotrun.tasks.decisions.policy import RetryPolicy, decide
from spotrun.tasks.history import HistoryStore
from spotrun.tasks.market.prices import Prices
from spotrun.tasks.providers.base import Market, ProvisionError, StopCause, StopWorker, WatchResult, Worker
from spotrun.tasks.settings import Settings
from spotrun.trainer.spec.job import JobSpec
from tests.fakes.provider import FakeAttempt, FakeProvider

H = 3600.0


def job(**fields: Any) -> JobSpec:
    return JobSpec.model_validate({"name": "dated", "recipe": "digits", "total_steps": 1000} | fields)


def attempt(
    n: int, *, resumed: int | None, durable: int, productive_s: float, startup_s: float
) -> AttemptRecord:
    return AttemptRecord(
        n,
        f"w{n}",
        "fake",
        started_at=100.0,
        ended_at=200.0,
        outcome=Outcome.PREEMPTED,
        cause="",
        resumed_from=resumed,
        last_durable_step=durable,
        productive_s=productive_s,
        extra={"started_training_at": 100.0 + startup_s},
    )


def test_the_step_rate_and_the_start_cost_come_from_history_else_the_job_file() -> None:
    history = [
        attempt(1, resumed=None, durable=100, productive_s=50.0, startup_s=20.0),
        attempt(2, resumed=100, durable=400, productive_s=150.0, startup_s=40.0),
        attempt(3, resumed=400, durable=400, productive_s=0.0, startup_s=30.0),
    ]
    m = measure(job(seconds_per_step=9.0), history)
    assert (m.step_s, m.step_from, m.restart_s, m.restart_from) == (0.5, "history", 30.0, "history")
    m = measure(job(seconds_per_step=9.0), [])
    assert (m.step_s, m.step_from, m.restart_s, m.restart_from) == (
        9.0,
        "declared",
        DEFAULT_RESTART_S,
        "assumed",
    )
    assert measure(job(), []).step_s is None


# (job fields, done step, refused because, warned because); 1,000 steps at 1 s each, a 120 s start
SUBMISSIONS: list[tuple[dict[str, Any], int, str | None, str | None]] = [
    ({}, 0, None, None),  # neither a deadline nor a budget
    ({"deadline": "2h", "seconds_per_step": 1}, 0, None, None),
    ({"deadline": "15m", "seconds_per_step": 1}, 0, "even on on-demand", None),
    ({"deadline": "15m", "seconds_per_step": 1}, 900, None, None),  # 100 steps left
    ({"deadline": "2h"}, 0, None, "no step rate known"),
    ({"budget_usd": 0.1, "seconds_per_step": 1}, 0, "cannot pay", None),  # $0.28 on spot
    ({"budget_usd": 0.5, "seconds_per_step": 1}, 0, None, "but not on on-demand"),  # $0.95 on-demand
    ({"budget_usd": 5, "seconds_per_step": 1}, 0, None, None),
]


@pytest.mark.parametrize(("fields", "done", "refused", "warned"), SUBMISSIONS)
def test_a_job_that_cannot_make_its_deadline_or_budget_is_refused_with_the_numbers(
    fields: dict[str, Any], done: int, refused: str | None, warned: str | None
) -> None:
    j = job(**fields)
    problem, warning = submission_problem(
        j, now=0.0, start=0.0, done_step=done, measured=measure(j, []), prices=Prices(0.918, 3.06)
    )
    assert (problem is None) == (refused is None) and (warning is None) == (warned is None), (
        problem,
        warning,
    )
    for line, part in ((problem, refused), (warning, warned)):
        if part is not None:
            assert line is not None and part in line and "\n" not in line


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t

    def sleep(self, s: float) -> None:
        self.t += s


class Market_:
    """Launches that are refused for spot while `outage(t)` is true."""

    def __init__(self, clock: Clock, outage: Any) -> None:
        self.clock, self.outage, self.launched = clock, outage, []

    def __call__(self, market: Market) -> Worker:
        if market == "spot" and self.outage(self.clock.t):
            raise ProvisionError("no spot capacity", retryable=True)
        self.launched.append((self.clock.t, market))
        return Worker("w", "fake", 1, started_at=self.clock.t, market=market)


def chooser(j: JobSpec, clock: Clock, sink: PlainSink) -> MarketChooser:
    return MarketChooser(j, [], 0.0, sink, sleep=clock.sleep, clock=clock, poll_s=60.0)


def test_a_roomy_deadline_waits_an_outage_out_and_takes_spot_when_it_is_back() -> None:
    clock, sink = Clock(), PlainSink()
    launch = Market_(clock, lambda t: t < 600)
    worker, extra = chooser(job(deadline="10h", seconds_per_step=1), clock, sink).provision(launch, [], 0)
    assert launch.launched == [(600.0, "spot")] and worker.market == "spot"
    assert extra["market"] == "spot" and extra["waited_s"] == 600.0
    assert extra["deadline_at"] == 10 * H  # started at 0: the report's margin reads it back
    assert [p["choice"] for e, p in sink.events if e == MARKET_CHOSEN] == ["spot", "wait", "spot"]


def test_a_tight_deadline_buys_on_demand_when_spot_is_short() -> None:
    clock, sink = Clock(), PlainSink()
    launch = Market_(clock, lambda t: True)
    _, extra = chooser(job(deadline="20m", seconds_per_step=1), clock, sink).provision(launch, [], 0)
    assert launch.launched == [(0.0, "on-demand")] and extra["market"] == "on-demand"
    assert "no slack" in extra["market_reason"] or "reserve" in extra["market_reason"]


def test_max_wait_without_a_deadline_turns_to_on_demand_after_that_long_without_capacity() -> None:
    clock, sink = Clock(), PlainSink()
    launch = Market_(clock, lambda t: True)
    _, extra = chooser(job(max_wait_s=300), clock, sink).provision(launch, [], 0)
    assert launch.launched == [(300.0, "on-demand")]
    assert "max_wait_s 300" in extra["market_reason"]


@pytest.fixture
def settings(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Settings:
    monkeypatch.setenv("PREFECT_API_URL", "http://127.0.0.1:9/api")  # nothing may call Prefect
    return Settings(tmp_path / "home", f"sqlite:///{tmp_path / 'history.db'}")


def _attempts(settings: Settings) -> list[AttemptRecord]:
    store = HistoryStore.open(settings.database_url)
    try:
        return list(store.attempts(job="dated"))
    finally:
        store.close()


def test_the_loop_records_the_market_on_the_attempt_row(tmp_path: Path, settings: Settings) -> None:
    provider = FakeProvider([FakeAttempt()], checkpoint_every=100)
    provider.spot_refusals = 2
    j = job(deadline="10h", seconds_per_step=0.01, total_steps=100, storage=str(tmp_path / "store"))
    result = run_job(j, provider, RetryPolicy(), PlainSink(), settings=settings, sleep=lambda s: None)
    assert result.completed, result.message
    (row,) = _attempts(settings)
    assert row.outcome is Outcome.COMPLETED and row.extra["market"] == "spot"
    assert "spot" in row.extra["market_reason"] and provider.spot_refusals == 0


def test_an_impossible_deadline_is_refused_before_any_worker(tmp_path: Path, settings: Settings) -> None:
    provider = FakeProvider([FakeAttempt()])
    j = job(deadline="1m", seconds_per_step=1, storage=str(tmp_path / "store"))
    result = run_job(j, provider, RetryPolicy(), PlainSink(), settings=settings, sleep=lambda s: None)
    assert not result.completed and result.message.startswith("refused: deadline 1m is 0.02 h away")
    assert provider.provisioned == [] and _attempts(settings) == []


class Spot:
    """A spot launch for the move back: refused while `short`, else a worker (in the prewarm's thread)."""

    def __init__(self) -> None:
        self.short, self.calls = True, 0

    def __call__(self, extra: list[str]) -> Worker:
        self.calls += 1
        if self.short:
            raise ProvisionError("no spot capacity", retryable=True)
        return Worker("spot-1", "fake", 2, started_at=0.0, market="spot")


def _settle(prewarm: Prewarm) -> None:
    """Wait for the prewarm's thread without taking its worker."""
    thread = prewarm._thread
    if thread is not None:
        thread.join()


def test_an_on_demand_worker_moves_back_to_spot_once_a_spot_worker_stands_by() -> None:
    clock, sink, spot = Clock(), PlainSink(), Spot()
    c = chooser(job(deadline="30m", seconds_per_step=0.5, total_steps=3000), clock, sink)
    prewarm = Prewarm(spot)
    back = BackToSpot(c, prewarm, [], lambda: [])
    back.on_step(0)  # slack 300 s on on-demand holds 2 starts of 120 s: try spot ahead
    _settle(prewarm)
    back.on_step(10)  # refused for capacity: stays, spot short from now
    assert spot.calls == 1 and c.short_since == 0.0 and not prewarm.started
    clock.t = 30.0
    back.on_step(20)  # within the poll: not asked
    assert spot.calls == 1
    spot.short, clock.t = False, 61.0
    back.on_step(30)
    _settle(prewarm)
    with pytest.raises(StopWorker) as stop:
        back.on_step(40)
    assert stop.value.cause is StopCause.MARKET and "holds 2 restarts" in str(stop.value)
    assert c.short_since is None and prewarm.take() is not None
    assert [p["choice"] for e, p in sink.events if e == MARKET_CHOSEN] == ["spot"]


def test_an_on_demand_worker_stays_when_the_slack_cannot_pay_for_the_move() -> None:
    clock, sink, spot = Clock(), PlainSink(), Spot()
    spot.short = False
    c = chooser(job(deadline="30m", seconds_per_step=0.5, total_steps=3000), clock, sink)
    back = BackToSpot(c, Prewarm(spot), [], lambda: [])
    clock.t = 200.0  # 1,600 s left for 1,500 s of work: 100 s of slack, not two starts
    back.on_step(0)
    assert spot.calls == 0 and not back.prewarm.started


def test_a_move_back_to_spot_is_retried_at_once_and_uses_no_preemption() -> None:
    result = WatchResult(started_at=0.0, stopped_by=StopCause.MARKET, last_step=40)
    result.last_durable_step = 40
    outcome, cause = classify(result, completed=False)
    assert outcome is Outcome.PREEMPTED and cause.startswith("moved to spot by the market policy")
    moved = attempt(1, resumed=None, durable=40, productive_s=1.0, startup_s=1.0)
    moved.extra[MARKET_MOVE] = "spot"
    d = decide([moved], RetryPolicy(max_preemptions=1), random.Random(0))
    assert (d.action, d.delay_s) == ("retry", 0.0), d


def test_a_deadline_even_on_demand_cannot_make_is_announced_once_and_the_job_goes_on() -> None:
    clock, sink = Clock(), PlainSink()
    c = chooser(job(deadline="20m", seconds_per_step=1), clock, sink)
    assert c.decide([], 0).choice == "spot" and not sink.events  # 80 s of slack
    clock.t = 200.0  # 1,000 s of work and a 120 s start in the 1,000 s left
    assert c.decide([], 0).choice == "on-demand" and c.decide([], 10).choice == "on-demand"
    (risk,) = [p for e, p in sink.events if e == DEADLINE_AT_RISK]
    assert risk["deadline"].startswith("20m (1970-01-01 00:20 UTC)") and "late by 0.03 h" in risk["problem"]


def test_a_deadline_duration_counts_from_the_runs_slot(tmp_path: Path, settings: Settings) -> None:
    """A scheduled run that started an hour after its slot has an hour less (the flow passes the slot)."""
    provider = FakeProvider([FakeAttempt()], checkpoint_every=100)
    j = job(deadline="10h", seconds_per_step=0.01, total_steps=100, storage=str(tmp_path / "store"))
    slot = time.time() - H
    policy, sink = RetryPolicy(), PlainSink()
    result = run_job(j, provider, policy, sink, settings=settings, submitted=slot, sleep=lambda s: None)
    assert result.completed, result.message
    (row,) = _attempts(settings)
    assert row.extra["deadline_at"] == slot + 10 * H


def test_at_a_notice_the_replacement_goes_on_demand_when_spot_is_short_and_the_slack_says_so() -> None:
    clock, sink = Clock(), PlainSink()
    launch = Market_(clock, lambda t: True)  # no spot anywhere
    tight = chooser(job(deadline="20m", seconds_per_step=1), clock, sink)
    worker, reason = tight.replacement(launch, [], 0)
    assert worker.market == "on-demand" and launch.launched == [(0.0, "on-demand")]
    assert reason.startswith("prewarmed at the notice: ") and "reserve" in reason
    roomy = chooser(job(deadline="10h", seconds_per_step=1), clock, sink)
    with pytest.raises(ProvisionError):  # the policy would wait: the next attempt waits, cold
        roomy.replacement(launch, [], 0)
    spot = Market_(clock, lambda t: False)
    assert roomy.replacement(spot, [], 0)[0].market == "spot"


def test_a_budget_alone_is_checked_at_submission(tmp_path: Path, settings: Settings) -> None:
    provider = FakeProvider([FakeAttempt()])
    provider.prices = Prices(0.918, 3.06)
    j = job(budget_usd=0.1, seconds_per_step=1, storage=str(tmp_path / "store"))  # $0.28 even on spot
    result = run_job(j, provider, RetryPolicy(), PlainSink(), settings=settings, sleep=lambda s: None)
    assert not result.completed and "budget_usd 0.1 cannot pay" in result.message
    assert provider.provisioned == []


def test_a_warm_standby_on_spot_is_used_for_the_move_only_when_the_policy_says_spot() -> None:
    clock, sink, spot = Clock(), PlainSink(), Spot()
    spot.short = False
    standby = Prewarm(spot)
    standby.start(lambda: [])  # the warm pool's, started with the attempt
    _settle(standby)
    c = chooser(job(deadline="30m", seconds_per_step=0.5, total_steps=3000), clock, sink)
    back = BackToSpot(c, standby, [], lambda: [])
    clock.t = 200.0  # 100 s of slack on on-demand: not two starts, stays
    back.on_step(0)
    assert not back.mine and spot.calls == 1
    clock.t = 300.0
    with pytest.raises(StopWorker):  # 1,000 steps done: slack 700 s, and the standby is on spot
        back.on_step(1000)
    assert spot.calls == 1  # no second spot worker


def test_a_spot_launch_that_fails_for_another_reason_than_capacity_is_not_tried_again() -> None:
    clock, sink = Clock(), PlainSink()

    def broken(extra: list[str]) -> Worker:
        raise ProvisionError("no such image", retryable=False)

    c = chooser(job(deadline="30m", seconds_per_step=0.5, total_steps=3000), clock, sink)
    back = BackToSpot(c, Prewarm(broken), [], lambda: [])
    back.on_step(0)
    _settle(back.prewarm)
    back.on_step(1)
    clock.t = 1000.0
    back.on_step(2)
    assert back.off and not back.prewarm.started
