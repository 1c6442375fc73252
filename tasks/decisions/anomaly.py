"""Loss spikes and throughput collapses: the watchdog's rules beyond silence, as pure state machines.

A loss spike: `patience` consecutive loss samples above `factor` x the median of the `window` samples
before them. The median, not the mean, so that one spiked sample does not raise its own bar; samples
judged spiked never enter the window. A median at or below zero (a loss that is not a positive
error, such as a log-likelihood ratio) cannot be judged by a ratio: the rule then waits. What the
controller samples are the trainer's `step` records: every step with `log_every: 1` and steps over
0.25 s, else about four a second (the status reporter's rate limit), so a spike shorter than the
sampling gap can go unseen; a divergence (the loss staying up) cannot.

The remedy (tasks/control/rollback.py): the state after a spike is suspect, so the job goes back to
the newest checkpoint at or before the last good sample, every newer checkpoint is quarantined, and
the data of the steps from that checkpoint to the first spiked sample is skipped (those batches may
have caused it: replaying them replays the spike, as PaLM's authors found). `rollback_target` and
`skip_steps` are that rule.

A throughput collapse: the steps per second over the last `window_s` below `factor` x the median rate
of the attempt before that window (a throttled GPU, a degraded network, a noisy neighbour). The state
is fine and the host is not, so the worker is stopped with its emergency checkpoint and the job
continues on a fresh one. Pauses that are no collapse restart the window: a save the loop waits for,
an evaluation section (`reset`).
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

MIN_BASELINE = 5  # fewer good losses (or rate samples) than this: no bar to compare with yet
RATES = 4096  # rate samples kept per attempt (the newest): about 17 minutes at four records a second


@dataclass(frozen=True)
class Spike:
    """A loss spike as found: the first spiked sample's step and the sample before it."""

    first_bad_step: int
    last_good_step: int  # 0: no good sample this attempt (the bar came from none: cannot happen here)
    loss: float  # the sample that completed the patience
    median: float
    factor: float
    samples: int  # spiked samples in a row

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def describe(self) -> str:
        return (
            f"loss spike: {self.samples} losses in a row above {self.factor:g} x the median "
            f"{self.median:.4g} from step {self.first_bad_step} (last {self.loss:.4g})"
        )


class LossSpikes:
    """Feed it (step, loss) samples in order; `observe` returns the Spike once the rule holds."""

    def __init__(self, factor: float, window: int, patience: int) -> None:
        self.factor, self.patience = factor, patience
        self.good: deque[float] = deque(maxlen=window)
        self.last_good_step = 0
        self.bad: list[tuple[int, float]] = []

    def observe(self, step: int, loss: float) -> Spike | None:
        """The spike, when this sample completes one; None otherwise (a non-finite loss is no sample:
        the trainer itself stops on those, exit DIVERGED)."""
        if loss != loss or loss in (float("inf"), float("-inf")):
            return None
        if len(self.good) >= MIN_BASELINE:
            median = statistics.median(self.good)
            if median > 0 and loss > self.factor * median:
                self.bad.append((step, loss))
                if len(self.bad) < self.patience:
                    return None
                return Spike(
                    first_bad_step=self.bad[0][0],
                    last_good_step=self.last_good_step,
                    loss=loss,
                    median=median,
                    factor=self.factor,
                    samples=len(self.bad),
                )
        self.bad = []
        self.good.append(loss)
        self.last_good_step = step
        return None


@dataclass(frozen=True)
class Collapse:
    """A throughput collapse as found."""

    step: int
    rate: float  # steps per second over the window
    baseline: float  # the attempt's median rate before it
    factor: float
    window_s: float

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def describe(self) -> str:
        return (
            f"throughput collapse: {self.rate:.3g} steps/s over {self.window_s:g} s to step {self.step}, "
            f"below {self.factor:g} x the attempt's median {self.baseline:.3g}"
        )


class Throughput:
    """Feed it (t, step) of each step record (the trainer's clock); `observe` returns the Collapse."""

    def __init__(self, factor: float, window_s: float) -> None:
        self.factor, self.window_s = factor, window_s
        self.samples: deque[tuple[float, int]] = deque()  # since the window's last reset
        self.rates: deque[tuple[float, float]] = deque(maxlen=RATES)  # (t, steps/s between two records)

    def reset(self) -> None:
        """A pause that is no collapse (a blocking save, an evaluation): the window starts again."""
        self.samples.clear()

    def observe(self, t: float, step: int) -> Collapse | None:
        if self.samples:
            t0, s0 = self.samples[-1]
            if t > t0 and step > s0:
                self.rates.append((t, (step - s0) / (t - t0)))
        self.samples.append((t, step))
        while len(self.samples) > 1 and self.samples[1][0] <= t - self.window_s:
            self.samples.popleft()
        start_t, start_step = self.samples[0]
        if t - start_t < self.window_s:
            return None
        before = [r for at, r in self.rates if at <= start_t]
        if len(before) < MIN_BASELINE:
            return None
        baseline = statistics.median(before)
        rate = (step - start_step) / (t - start_t)
        if rate >= self.factor * baseline:
            return None
        return Collapse(step=step, rate=rate, baseline=baseline, factor=self.factor, window_s=self.window_s)


def rollback_target(committed: Sequence[int], last_good_step: int) -> int | None:
    """The checkpoint to go back to: the newest committed step at or before the last good sample
    (None: none, the job starts again from scratch)."""
    older = [s for s in committed if s <= last_good_step]
    return max(older) if older else None


def quarantined_by(committed: Sequence[int], target: int | None) -> list[int]:
    """The committed steps a rollback to `target` takes out of the timeline: every newer one."""
    return sorted(s for s in committed if target is None or s > target)


def skip_steps(target: int | None, first_bad_step: int) -> int:
    """How many steps' data the resumed attempt skips: from the target to the first spiked step."""
    return max(0, first_bad_step - (target or 0))
