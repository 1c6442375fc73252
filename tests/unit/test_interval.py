"""`checkpoint.every: auto`: Young/Daly's interval, the measured cost of a checkpoint, and the MTBF."""

from __future__ import annotations

import math

import pytest

from spotrun.tasks.decisions.attempts import AttemptRecord, Outcome
from spotrun.tasks.decisions.mtbf import estimate_mtbf
from spotrun.trainer.errors import ConfigError
from spotrun.trainer.saving.interval import MAX_INTERVAL_S, MIN_INTERVAL_S, IntervalTuner, young_daly
from spotrun.trainer.spec.job import parse_spec


@pytest.mark.parametrize(
    ("cost", "mtbf", "want"),
    [
        (0.5, 3600, math.sqrt(2 * 0.5 * 3600)),  # 60 s: half a second per save, a reclaim an hour
        (2.0, 7200, math.sqrt(2 * 2.0 * 7200)),  # ~170 s
        (0.001, 600, MIN_INTERVAL_S),  # ~1.1 s: clamped up, the machinery would dominate
        (30.0, 10 * 24 * 3600, MAX_INTERVAL_S),  # ~2.3 h: clamped down to an hour of work at risk
        (0.0, 3600, MIN_INTERVAL_S),
    ],
)
def test_young_daly(cost: float, mtbf: float, want: float) -> None:
    assert young_daly(cost, mtbf) == pytest.approx(want)


def test_young_daly_refuses_nonsense() -> None:
    with pytest.raises(ValueError):
        young_daly(1.0, 0.0)


def test_tuner_measures_stall_plus_slowdown_beside_the_writer() -> None:
    t = IntervalTuner(mtbf_s=3600, prior_cost_s=0.01)
    assert not t.choice.measured and t.choice.seconds == pytest.approx(math.sqrt(2 * 0.01 * 3600))
    for _ in range(9):
        assert t.step(0.10, save_in_flight=False) is None  # quiet steps: median 0.10 s
    t.saved(stall_s=0.05)
    for _ in range(4):
        assert t.step(0.15, save_in_flight=True) is None  # 4 steps 0.05 s slower beside the writer
    choice = t.step(0.10, save_in_flight=False)  # the save is done: its cost is known
    assert choice is not None and choice.measured
    assert choice.cost_s == pytest.approx(0.05 + 4 * 0.05)  # 0.25 s
    assert choice.seconds == pytest.approx(math.sqrt(2 * 0.25 * 3600))  # 42.4 s
    # the next checkpoint costs 0.05 s (stall only): the estimate moves half way, 0.15 s
    t.saved(stall_s=0.05)
    choice = t.step(0.10, save_in_flight=False)
    assert choice is not None and choice.cost_s == pytest.approx(0.15)
    # the same cost again: 0.10 s -> a move under 10 % is not reported
    t.saved(stall_s=0.10)
    t.step(0.10, save_in_flight=False)
    t.saved(stall_s=0.10)
    assert t.step(0.10, save_in_flight=False) is None


def _attempt(
    outcome: Outcome, wall_s: float, provider: str = "aws", code: str | None = None, lost: int = 0
) -> AttemptRecord:
    return AttemptRecord(
        attempt=1,
        worker_id="w",
        provider=provider,
        started_at=0.0,
        ended_at=wall_s,
        outcome=outcome,
        cause="",
        wall_s=wall_s,
        trainer_code=code,
        lost_steps=lost,
    )


@pytest.mark.parametrize(
    ("history", "want_mtbf", "reclaims"),
    [
        ([], 7200.0, 0),  # no history: the prior
        ([_attempt(Outcome.COMPLETED, 3600)], (3600 + 7200) / 1, 0),  # an hour without a reclaim
        ([_attempt(Outcome.PREEMPTED, 600, lost=40), _attempt(Outcome.LOST, 600)], (1200 + 7200) / 3, 2),
        # a notice's emergency checkpoint kept every step: a restart, but no work lost
        ([_attempt(Outcome.PREEMPTED, 600), _attempt(Outcome.PREEMPTED, 600, lost=7)], (1200 + 7200) / 2, 1),
        ([_attempt(Outcome.PREEMPTED, 600, code="STOPPED", lost=3)], (600 + 7200) / 1, 0),  # --max-steps
        ([_attempt(Outcome.CRASHED, 600), _attempt(Outcome.CANCELLED, 600)], (1200 + 7200) / 1, 0),
        ([_attempt(Outcome.PREEMPTED, 600, provider="local")], 7200.0, 0),  # another provider's history
    ],
)
def test_mtbf_from_history(history: list[AttemptRecord], want_mtbf: float, reclaims: int) -> None:
    est = estimate_mtbf(history, "aws", prior_s=7200)
    assert est.mtbf_s == pytest.approx(want_mtbf) and est.reclaims == reclaims


def test_every_auto_replaces_the_fixed_triggers() -> None:
    base = {"name": "j", "recipe": "digits", "total_steps": 10}
    spec = parse_spec({**base, "checkpoint": {"every": "auto"}})
    assert spec.checkpoint.every_steps is None and spec.checkpoint.every_seconds is None
    with pytest.raises(ConfigError, match="every: auto chooses the interval itself; remove every_steps"):
        parse_spec({**base, "checkpoint": {"every": "auto", "every_steps": 50}})
