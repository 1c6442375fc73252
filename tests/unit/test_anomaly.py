"""The watchdog's rules beyond silence (tasks/decisions/anomaly.py) as tables, their wiring into the
controller's watchdog on a clock the test moves, the rollback's budget, and the trainer's data skip."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from spotrun.tasks.control.trainer_args import skip_args
from spotrun.tasks.control.watchdog import ProgressWatchdog
from spotrun.tasks.decisions.anomaly import (
    LossSpikes,
    Throughput,
    quarantined_by,
    rollback_target,
    skip_steps,
)
from spotrun.tasks.decisions.attempts import AttemptRecord, Outcome
from spotrun.tasks.decisions.outcome import classify
from spotrun.tasks.decisions.policy import RetryPolicy, decide
from spotrun.tasks.providers.base import StopCause, StopWorker, WatchResult
from spotrun.trainer.__main__ import _skip
from spotrun.trainer.errors import ConfigError
from spotrun.trainer.recipes.data import Position
from spotrun.trainer.spec.watchdog import WatchdogOptions
from spotrun.trainer.telemetry.records import Exit, Section, Started, Step

FLAT = [1.0, 0.9, 1.1, 1.0, 0.95, 1.05]
SPIKE_CASES = [
    # (what, losses from step 1 on, factor, patience, the spike's (first bad, last good) or None)
    ("flat: nothing", FLAT * 3, 3.0, 1, None),
    ("one spike, patience 1", [*FLAT, 5.0], 3.0, 1, (7, 6)),
    ("one noisy batch, patience 2", [*FLAT, 5.0, 1.0, 5.0], 3.0, 2, None),
    ("sustained, patience 3", [*FLAT, 5.0, 6.0, 7.0], 3.0, 3, (7, 6)),
    ("below the factor", [*FLAT, 2.9, 2.9, 2.9], 3.0, 1, None),
    ("too few to judge", [1.0, 1.0, 9.0], 3.0, 1, None),
    ("a negative median is not judged", [-1.0] * 6 + [5.0], 3.0, 1, None),
    ("NaN is no sample", [*FLAT, float("nan"), 5.0], 3.0, 1, (8, 6)),
    ("declining: the median lags", [4.0, 3.0, 2.0, 1.5, 1.0, 0.8, 0.7, 3.0], 3.0, 1, None),
    ("declining, then far above", [4.0, 3.0, 2.0, 1.5, 1.0, 0.8, 0.7, 6.0], 3.0, 1, (8, 7)),
]  # fmt: skip  # a decision table, one case per row


@pytest.mark.parametrize(
    ("losses", "factor", "patience", "expect"), [c[1:] for c in SPIKE_CASES], ids=[c[0] for c in SPIKE_CASES]
)
def test_loss_spikes(
    losses: list[float], factor: float, patience: int, expect: tuple[int, int] | None
) -> None:
    rule = LossSpikes(factor, window=20, patience=patience)
    found = [s for step, loss in enumerate(losses, 1) if (s := rule.observe(step, loss)) is not None]
    got = (found[0].first_bad_step, found[0].last_good_step) if found else None
    assert got == expect


def test_a_collapse_needs_a_whole_window_below_the_factor_and_a_pause_restarts_it() -> None:
    rule = Throughput(factor=0.25, window_s=10.0)
    t, step = 0.0, 0
    for _ in range(40):  # 100 steps a second, a record every 0.25 s
        t, step = t + 0.25, step + 25
        assert rule.observe(t, step) is None
    for _ in range(39):  # 10 steps a second: collapsed, but not yet for a whole window
        t, step = t + 1.0, step + 10
        found = rule.observe(t, step)
        if found is not None:
            break
    assert found is not None and found.baseline == pytest.approx(100) and found.rate < 25
    assert 5.0 < t - 40 * 0.25 <= 10.0  # within one window of the collapse's start, not at once
    rule = Throughput(factor=0.25, window_s=10.0)
    for i in range(1, 41):
        assert rule.observe(i * 0.25, i * 25) is None
    rule.reset()  # an evaluation: 20 s without steps is no collapse
    assert rule.observe(30.0, 1001) is None and rule.observe(30.25, 1026) is None


TARGET_CASES = [
    # committed steps, last good step -> target, quarantined, skip from a first bad step of last good + 1
    ([10, 20, 30, 40], 25, 20, [30, 40], 6),
    ([10, 20, 30, 40], 20, 20, [30, 40], 1),
    ([10, 20], 45, 20, [], 26),
    ([30, 40], 25, None, [30, 40], 26),
    ([], 5, None, [], 6),
]  # fmt: skip  # a decision table, one case per row


@pytest.mark.parametrize(("committed", "good", "target", "quarantined", "skip"), TARGET_CASES)
def test_rollback_target_quarantine_and_skip(
    committed: list[int], good: int, target: int | None, quarantined: list[int], skip: int
) -> None:
    assert rollback_target(committed, good) == target
    assert quarantined_by(committed, target) == quarantined
    assert skip_steps(target, good + 1) == skip


def _dog(**rules: Any) -> ProgressWatchdog:
    return ProgressWatchdog(WatchdogOptions(**rules), {}, fallback_s=60.0, clock=lambda: 0.0)


def test_a_spike_is_killed_at_the_next_tick_and_named_in_the_result() -> None:
    dog = _dog(loss_spike={"factor": 3, "window": 10, "patience": 2})
    dog.observe(Started(t=0.0, step=0))
    for i, loss in enumerate([1.0] * 8 + [9.0, 9.5], 1):
        dog.observe(Step(t=i * 0.1, step=i, loss=loss))
    fired = dog.check(1.0)
    assert fired is not None and fired["section"] == "loss_spike" and fired["first_bad_step"] == 9
    assert dog.check(1.2) is None  # killed once
    result = dog.finish(WatchResult(started_at=0.0))
    outcome, cause = classify(result, completed=False)
    assert outcome is Outcome.ROLLED_BACK and "loss spike" in cause and "rolled back" in cause


def test_a_diverged_exit_is_a_spike_when_the_rule_is_on() -> None:
    for rules, expect in (({"loss_spike": {}}, Outcome.ROLLED_BACK), ({}, Outcome.CRASHED)):
        dog = _dog(**rules)
        dog.observe(Started(t=0.0, step=0))
        for i in range(1, 8):
            dog.observe(Step(t=i * 0.1, step=i, loss=1.0))
        result = WatchResult(started_at=0.0)
        result.fold(
            Exit(t=1.0, code=3, name="DIVERGED", error="TrainingDiverged: loss is nan at step 8", step=7)
        )
        outcome, _ = classify(dog.finish(result), completed=False)
        assert outcome is expect
        if expect is Outcome.ROLLED_BACK:
            fired = result.hung["fired"] if result.hung else {}
            assert (fired["first_bad_step"], fired["last_good_step"], fired["diverged"]) == (8, 7, True)


def test_a_collapse_stops_the_worker_and_is_a_hung_attempt() -> None:
    dog = _dog(throughput={"factor": 0.25, "window_s": 2.0})
    dog.observe(Started(t=0.0, step=0))
    step, t = 0, 0.0
    for _ in range(20):
        t, step = t + 0.25, step + 25
        dog.observe(Step(t=t, step=step))
    dog.observe(Section(t=t, step=step, name="eval", begin=True))  # no rule inside an evaluation
    dog.observe(Section(t=t + 30, step=step, name="eval", begin=False))
    t += 30
    with pytest.raises(StopWorker) as stopped:
        for _ in range(10):
            t, step = t + 1.0, step + 1
            dog.observe(Step(t=t, step=step))
    assert stopped.value.cause is StopCause.WATCHDOG and "throughput collapse" in str(stopped.value)
    result = WatchResult(started_at=0.0)
    result.stopped_by = StopCause.WATCHDOG
    outcome, cause = classify(dog.finish(result), completed=False)
    assert outcome is Outcome.HUNG and "throughput collapse" in cause and "fresh worker" in cause


def _rolled(n: int) -> list[AttemptRecord]:
    return [
        AttemptRecord(
            attempt=i,
            worker_id=f"w{i}",
            provider="local",
            started_at=0.0,
            ended_at=1.0,
            outcome=Outcome.ROLLED_BACK,
            cause="loss spike",
            last_step=10 * i,
        )
        for i in range(1, n + 1)
    ]


def test_rollbacks_have_their_own_budget() -> None:
    import random

    policy = RetryPolicy(max_rollbacks=2)
    assert decide(_rolled(1), policy, random.Random(0)).action == "retry"
    assert decide(_rolled(1), policy, random.Random(0)).delay_s == 0.0
    gave_up = decide(_rolled(2), policy, random.Random(0))
    assert gave_up.action == "give_up" and "2 rollbacks" in gave_up.reason


def test_every_rollback_that_skips_is_passed_to_the_next_trainers() -> None:
    rows = _rolled(3)
    rows[0].extra["rollback"] = {"to_step": 100, "skip_steps": 6}
    rows[1].extra["rollback"] = {"to_step": None, "skip_steps": 4}
    rows[2].extra["rollback"] = {"to_step": 50, "skip_steps": 0}  # loss_spike.skip: false
    assert skip_args(rows) == ["--skip-steps", "6@100", "--skip-steps", "4@0"]


@pytest.mark.parametrize(
    ("start", "steps", "per_epoch", "k", "expect"),
    [
        ((0, 0), 3, 10, 1, (0, 3)),
        ((0, 8), 3, 10, 1, (1, 1)),
        ((0, 8), 1, 10, 3, (1, 3)),
        ((2, 4), 0, 10, 1, (2, 4)),
    ],
)
def test_a_skip_draws_what_the_stream_would(
    start: tuple[int, int], steps: int, per_epoch: int, k: int, expect: tuple[int, int]
) -> None:
    pos = Position(*start)
    pos.skip(steps, per_epoch, k)
    assert (pos.epoch, pos.batch) == expect


def test_skip_steps_argument_and_rules_validation() -> None:
    assert _skip("6@100") == (100, 6)
    for bad in ("6", "x@1", "6@", "-1@3"):
        with pytest.raises(ConfigError, match="--skip-steps"):
            _skip(bad)
    for bad_rule in (
        {"loss_spike": {"factor": 1.0}},
        {"throughput": {"factor": 1.5}},
        {"loss_spike": {"x": 1}},
    ):
        with pytest.raises(ValidationError):
            WatchdogOptions(**bad_rule)
