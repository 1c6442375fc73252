"""`checkpoint.every: auto`: the checkpoint interval from measured costs (Young/Daly).

With a checkpoint every T seconds of training, a cost C per checkpoint (what it takes from the loop)
and failures every M seconds on average, the expected waste per second is C/T (checkpointing) plus
T/(2M) (half an interval of work lost per failure); it is least at T = sqrt(2 C M) (Young 1974; Daly
2006 adds terms that matter only when C is a sizeable share of M). CheckFreq (FAST '21) keeps the
overhead at a few percent the same way, from measured costs.

C is measured here, per checkpoint: the loop's stall at the save, plus the extra time of the steps
that ran while the writer worked (their mean time above the mean of steps with no save in flight).
M comes from the controller (`--mtbf-s`: the job's own reclaims in its SQL history, else the spec's
prior). Both go into each recomputation, after every checkpoint.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

MIN_INTERVAL_S = 5.0  # below this the checkpoint machinery itself dominates; never checkpoint faster
MAX_INTERVAL_S = 3600.0  # an hour of work is the most a reclaim may cost, whatever M says


def young_daly(cost_s: float, mtbf_s: float, lo: float = MIN_INTERVAL_S, hi: float = MAX_INTERVAL_S) -> float:
    """sqrt(2 C M), clamped to [lo, hi]."""
    if cost_s < 0 or mtbf_s <= 0:
        raise ValueError(f"need cost >= 0 and mtbf > 0, got {cost_s}, {mtbf_s}")
    return min(hi, max(lo, math.sqrt(2.0 * cost_s * mtbf_s)))


@dataclass(frozen=True)
class Choice:
    seconds: float
    cost_s: float  # per checkpoint, as measured (or the prior before the first)
    mtbf_s: float
    measured: bool

    def reason(self) -> str:
        how = "measured" if self.measured else "estimated before any checkpoint"
        return (
            f"every {self.seconds:.0f} s = sqrt(2 x {self.cost_s:.3f} s per checkpoint ({how}) "
            f"x {self.mtbf_s:.0f} s between reclaims), clamped to [{MIN_INTERVAL_S:g}, {MAX_INTERVAL_S:g}]"
        )


class IntervalTuner:
    """Keeps the interval at Young/Daly's optimum as checkpoint costs are measured."""

    def __init__(self, mtbf_s: float, prior_cost_s: float, window: int = 50) -> None:
        self.mtbf_s = mtbf_s
        self.cost_s = prior_cost_s
        self.measured = False
        self._quiet: deque[float] = deque(maxlen=window)  # step times with no save in flight
        self._busy: list[float] = []  # step times while the last save was in flight
        self._stall = 0.0
        self._pending = False  # a save started whose cost is not accounted yet
        self.choice = self._choose()

    def saved(self, stall_s: float) -> None:
        """A checkpoint started and blocked the loop `stall_s`."""
        self._stall += stall_s
        self._pending = True

    def step(self, seconds: float, save_in_flight: bool) -> Choice | None:
        """One training step took `seconds` (the step alone, not a save after it). When the save in
        flight has finished, its cost is known: recompute, and return the new choice if it moved by
        more than 10 % (worth reporting)."""
        if save_in_flight:
            self._busy.append(seconds)
            return None
        if not self._pending:
            self._quiet.append(seconds)
            return None
        self._account()
        new = self._choose()
        moved = abs(new.seconds - self.choice.seconds) > 0.1 * self.choice.seconds or not self.choice.measured
        self.choice = new
        return new if moved else None

    def _account(self) -> None:
        base = sorted(self._quiet)[len(self._quiet) // 2] if self._quiet else None
        slowdown = sum(max(0.0, t - base) for t in self._busy) if base is not None else 0.0
        cost = self._stall + slowdown
        # the newest measurement weighs half: costs drift (page cache, network), one outlier does not rule
        self.cost_s = cost if not self.measured else 0.5 * self.cost_s + 0.5 * cost
        self.measured, self._busy, self._stall, self._pending = True, [], 0.0, False

    def _choose(self) -> Choice:
        return Choice(young_daly(self.cost_s, self.mtbf_s), self.cost_s, self.mtbf_s, self.measured)
