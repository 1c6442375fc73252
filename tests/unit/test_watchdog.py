"""The progress watchdog: its calibration (a table), the `watchdog:` section's validation, and the
controller-side watchdog on a clock the test moves (tasks/control/watchdog.py)."""

from __future__ import annotations

import threading
from typing import Any

import pytest
from pydantic import ValidationError

from spotrun.tasks.control.watchdog import ProgressWatchdog, for_attempt
from spotrun.tasks.decisions.attempts import AttemptRecord, Outcome
from spotrun.tasks.decisions.watchdog import Limit, describe, history_figures, limit, limits, p99
from spotrun.tasks.providers.base import WatchResult
from spotrun.trainer.spec.job import JobSpec
from spotrun.trainer.spec.watchdog import WatchdogOptions
from spotrun.trainer.telemetry.records import Durable, Exit, Saving, Section, Started, Step, Stopping

MS = [0.002] * 19 + [0.004]  # 20 steps of 2 ms, one of 4 ms
KW: dict[str, Any] = {
    "fixed_s": None,
    "floor_s": 30.0,
    "multiplier": 20.0,
    "min_samples": 20,
    "fallback_s": 60.0,
}
LIMIT_CASES = [
    ("nothing measured: the heartbeat", [], [], {}, Limit(60.0, "heartbeat")),
    ("fixed in the job file", MS, [9.0], {"fixed_s": 5.0}, Limit(5.0, "job file")),
    ("ms steps: the floor", MS, [], {}, Limit(30.0, "attempt", 0.004, 20)),
    ("ms steps, small floor", MS, [], {"floor_s": 2.0}, Limit(2.0, "attempt", 0.004, 20)),
    ("5 s steps: 20 x p99", [5.0] * 19 + [6.0], [], {}, Limit(120.0, "attempt", 6.0, 20)),
    ("too few own: history", MS[:19], [0.5, 2.0], {}, Limit(40.0, "history", 2.0, 2)),
    ("too few own, no history", MS[:19], [], {}, Limit(60.0, "heartbeat")),
    ("own beats history", MS, [2.0], {"floor_s": 1.0}, Limit(1.0, "attempt", 0.004, 20)),
    ("multiplier 10", [5.0] * 20, [], {"multiplier": 10.0}, Limit(50.0, "attempt", 5.0, 20)),
]  # fmt: skip  # a decision table, one case per row


@pytest.mark.parametrize(
    ("own", "history", "change", "expect"), [c[1:] for c in LIMIT_CASES], ids=[c[0] for c in LIMIT_CASES]
)
def test_limit(own: list[float], history: list[float], change: dict[str, Any], expect: Limit) -> None:
    assert limit(own, history, **{**KW, **change}) == expect


@pytest.mark.parametrize(
    ("samples", "q"), [([3.0], 3.0), ([1.0, 2.0, 3.0], 3.0), ([float(i) for i in range(1, 201)], 198.0)]
)
def test_p99_is_nearest_rank(samples: list[float], q: float) -> None:
    assert p99(samples) == q


def _row(measured: dict[str, Any] | None) -> AttemptRecord:
    extra = {"watchdog": {"measured": measured}} if measured is not None else {}
    return AttemptRecord(
        attempt=1,
        worker_id="w",
        provider="local",
        started_at=0.0,
        ended_at=1.0,
        outcome=Outcome.PREEMPTED,
        cause="c",
        extra=extra,
    )


def test_history_figures_and_the_next_attempts_limits() -> None:
    rows = [
        _row({"step_p99_s": 0.5, "save_p99_s": 4.0, "startup_s": 1.0}),
        _row(None),  # an older row, or a provision failure: no figures
        _row({"step_p99_s": 0.01, "save_p99_s": None, "startup_s": 0.2}),
    ]  # oldest first, as SQL returns them
    figures = history_figures(r.extra for r in reversed(rows))
    assert figures == {"startup": [0.2, 1.0], "step": [0.01, 0.5], "save": [4.0]}
    opts = WatchdogOptions(step_floor_s=2, save_floor_s=5, startup_floor_s=1)
    got = limits(opts, {}, figures, fallback_s=60)
    assert got["step"] == Limit(10.0, "history", 0.5, 2)  # the largest recent p99, x 20
    assert (got["save"].seconds, got["startup"].seconds) == (80.0, 20.0)
    assert for_attempt(opts, rows, 60).limits() == got


def test_watchdog_options_validation() -> None:
    with pytest.raises(ValidationError, match="step_s fixes the timeout, so step_floor_s would never apply"):
        WatchdogOptions(step_s=5, step_floor_s=1)
    with pytest.raises(ValidationError, match="multiplier"):
        WatchdogOptions(multiplier=1)
    with pytest.raises(ValidationError, match="min_samples"):
        WatchdogOptions(min_samples=1)
    with pytest.raises(ValidationError, match="save_floor_s"):
        WatchdogOptions(save_floor_s=0)
    with pytest.raises(ValidationError, match="extra"):
        WatchdogOptions.model_validate({"step_timeout_s": 5})
    spec = JobSpec.model_validate(
        {"name": "j", "recipe": "digits", "total_steps": 10, "watchdog": {"step_floor_s": 2, "save_s": 90}}
    )
    assert spec.watchdog.floor("step") == 2.0 and spec.watchdog.fixed("save") == 90.0
    assert spec.watchdog.fixed("step") is None and JobSpec.model_validate(spec.model_dump()) == spec


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _dog(**opts: Any) -> tuple[ProgressWatchdog, Clock]:
    clock = Clock()
    options = WatchdogOptions(**{"step_floor_s": 2.0, "save_floor_s": 5.0, "startup_floor_s": 3.0, **opts})
    history = {"startup": [0.1], "step": [], "save": [0.2]}
    return ProgressWatchdog(options, history, fallback_s=60.0, clock=clock), clock


def _steps(dog: ProgressWatchdog, clock: Clock, first: int, n: int, dt: float = 0.01) -> None:
    for i in range(first, first + n):
        clock.now += dt
        dog.observe(Step(t=clock.now, step=i))


def test_a_step_that_stops_is_caught_at_its_calibrated_limit() -> None:
    dog, clock = _dog()
    dog.observe(Started(t=clock.now, step=0))
    clock.now += 2.9
    assert dog.check(clock.now) is None  # start-up: 3 s (the history's 0.1 s x 20 is below the floor)
    _steps(dog, clock, 1, 10)
    assert dog.check(clock.now + 59) is None  # 9 step times, no history: the heartbeat's, not enforced
    _steps(dog, clock, 11, 30)
    clock.now += 1.9
    assert dog.check(clock.now) is None
    clock.now += 0.2
    fired = dog.check(clock.now)
    assert fired is not None
    assert (fired["section"], fired["step"], fired["timeout_s"], fired["source"]) == (
        "step",
        40,
        2.0,
        "attempt",
    )
    result = dog.finish(WatchResult(started_at=0.0))
    assert result.hung is not None and result.hung["fired"]["silent_s"] == pytest.approx(2.1)
    measured = result.facts["watchdog"]["measured"]
    assert measured["steps"] == 39 and measured["startup_s"] == pytest.approx(2.91)


def test_a_save_is_timed_from_saving_to_durable_and_the_step_clock_waits() -> None:
    dog, clock = _dog()
    dog.observe(Started(t=clock.now, step=0))
    _steps(dog, clock, 1, 25)
    dog.observe(Saving(t=clock.now, step=25))
    clock.now += 4.9  # a blocking save: longer than a step's 2 s, shorter than the save's 5 s
    assert dog.check(clock.now) is None
    dog.observe(Durable(t=clock.now, step=25))
    clock.now += 1.9
    assert dog.check(clock.now) is None  # the step clock restarted at durable
    _steps(dog, clock, 26, 5)
    dog.observe(Saving(t=clock.now, step=30))
    clock.now += 5.1
    fired = dog.check(clock.now)
    assert fired is not None and (fired["section"], fired["saving_step"], fired["source"]) == (
        "save",
        30,
        "history",
    )


@pytest.mark.parametrize("section_s", [None, 30.0])
def test_an_evaluation_is_no_hung_step_and_is_timed_only_if_the_job_says_so(section_s: float | None) -> None:
    dog, clock = _dog(section_s=section_s)
    dog.observe(Started(t=clock.now, step=0))
    _steps(dog, clock, 1, 30)
    dog.observe(Section(t=clock.now, name="eval", begin=True, step=30))
    clock.now += 29.0  # far past the 2 s step limit
    assert dog.check(clock.now) is None
    if section_s is None:
        clock.now += 1000
        assert dog.check(clock.now) is None
        dog.observe(Section(t=clock.now, name="eval", begin=False, step=30))
        clock.now += 1.9
        assert dog.check(clock.now) is None  # the step clock starts again at the section's end
        clock.now += 0.2
        fired = dog.check(clock.now)
        assert fired is not None and fired["section"] == "step"
    else:
        clock.now += 1.1
        fired = dog.check(clock.now)
        assert fired is not None and (fired["section"], fired["name"], fired["source"]) == (
            "section",
            "eval",
            "job file",
        )
        assert describe(fired).startswith("hung: eval after step 30 not over for 30.1 s")


@pytest.mark.parametrize(
    "end", [Stopping(t=0.0, reason="SIGTERM", step=5), Exit(t=0.0, code=0, name="COMPLETED", step=5)]
)
def test_a_stop_or_an_exit_stands_it_down(end: Stopping | Exit) -> None:
    dog, clock = _dog()
    dog.observe(Started(t=clock.now, step=0))
    _steps(dog, clock, 1, 30)
    dog.observe(end)
    clock.now += 1000
    assert dog.check(clock.now) is None


def test_disabled_measures_but_never_fires() -> None:
    dog, clock = _dog(enabled=False)
    dog.observe(Started(t=clock.now, step=0))
    _steps(dog, clock, 1, 30)
    clock.now += 1000
    assert dog.check(clock.now) is None
    assert dog.finish(WatchResult(started_at=0.0)).facts["watchdog"]["measured"]["steps"] == 29


def test_the_guard_kills_once_and_only_while_it_guards() -> None:
    dog, clock = _dog()
    dog.observe(Started(t=clock.now, step=0))
    _steps(dog, clock, 1, 30)
    kills: list[int] = []
    killed = threading.Event()

    def kill() -> None:
        kills.append(1)
        killed.set()

    with dog.guard(kill, "w1"):
        clock.now += 10
        assert killed.wait(5)
    assert kills == [1] and dog.fired is not None
