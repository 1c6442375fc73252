"""Retry or stop: a pure decision over the attempts so far.

Preemptions and errors draw on separate budgets, as SkyPilot keeps a restart budget for user errors
apart from preemptions: a spot market reclaiming workers twenty times is normal weather and is retried
at once on a fresh worker, while a crash, a lost worker or a failed provision is retried after an
exponential backoff with jitter (so a fleet of flows does not stampede a recovering service). A hung
worker (the progress watchdog killed it: a stuck collective, a dead file system) has a budget of its own,
`max_hung`, and is retried at once on a fresh worker, unless it hung at the same step
`same_error_limit` times (a deadlock in the code, not the machine). A loss spike the watchdog's rule
caught (`rolled_back`: back to the checkpoint before it, its data skipped) has its own budget too,
`max_rollbacks`: a spike that comes back after each rollback is the run's own instability. Some
errors stop the run at once: a bad spec or an incompatible checkpoint (CONFIG_ERROR), a diverged loss
(DIVERGED, a retry from the same checkpoint repeats it; with `watchdog.loss_spike` set it is a spike,
rolled back), a provider that will never accept the setup,
and the same error at the same step recurring `same_error_limit` times (a deterministic bug).
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from spotrun.tasks.decisions.attempts import MARKET_MOVE, AttemptRecord, Outcome
from spotrun.tasks.decisions.outcome import FATAL_CODES

DuplicateRuns = Literal[
    "wait", "reject"
]  # what a second flow run of a running job does (tasks/ownership/job_slot.py)
ERROR_OUTCOMES = (Outcome.CRASHED, Outcome.LOST, Outcome.PROVISION_FAILED)
_HEX = re.compile(r"0x[0-9a-fA-F]+")
_NUMBER = re.compile(r"(?<!step )\b\d+(\.\d+)?\b")


class RetryPolicy(BaseModel):
    """When a failed attempt is retried, how soon, and when the run gives up."""

    model_config = ConfigDict(extra="forbid")

    max_preemptions: int = Field(
        default=20, ge=1, description="give up at this many preemptions (retried at once until then)"
    )
    max_errors: int = Field(
        default=3,
        ge=1,
        description="give up at this many errors: crashes, lost workers and failed provisions together",
    )
    backoff_base_s: float = Field(
        default=1, ge=0, description="wait before the retry after the first error; doubles with each error"
    )
    backoff_max_s: float = Field(default=60, ge=0, description="longest wait before a retry after an error")
    jitter: float = Field(
        default=0.5, ge=0, le=1, description="random spread of each wait, as a fraction (0.5: ±50%)"
    )
    max_hung: int = Field(
        default=3,
        ge=1,
        description="give up at this many hung attempts (the progress watchdog's kills; retried at once)",
    )
    max_rollbacks: int = Field(
        default=2,
        ge=1,
        description="give up at this many rollbacks (a loss spike: back to the checkpoint before it, "
        "retried at once)",
    )
    same_error_limit: int = Field(
        default=2,
        ge=2,
        description="give up when the same error recurs at the same step this many times",
    )
    duplicate_runs: DuplicateRuns = Field(
        default="wait",
        description="when this job is already running in another flow run: wait for it to end, "
        "or reject this run at once (it ends Failed and records no attempt)",
    )

    @model_validator(mode="after")
    def _max_above_base(self) -> RetryPolicy:
        if self.backoff_max_s < self.backoff_base_s:
            raise ValueError("backoff_max_s is below backoff_base_s: raise backoff_max_s or lower the base")
        return self


@dataclass(frozen=True)
class Decision:
    action: Literal["done", "retry", "give_up"]
    delay_s: float  # wait this long before the next attempt (retry only)
    reason: str  # one line; for give_up, the message the run fails with


def decide(attempts: list[AttemptRecord], policy: RetryPolicy, rng: random.Random) -> Decision:
    """What to do after the last of `attempts` (oldest first)."""
    if not attempts:
        return Decision("retry", 0.0, "first attempt")
    last = attempts[-1]
    if last.outcome is Outcome.COMPLETED:
        return Decision("done", 0.0, f"completed at step {last.last_step} in {len(attempts)} attempt(s)")
    if last.outcome is Outcome.PREEMPTED:
        n = _count(attempts, (Outcome.PREEMPTED,))
        if n >= policy.max_preemptions:
            return Decision(
                "give_up",
                0.0,
                f"gave up after {n} preemptions (budget {policy.max_preemptions}): {last.cause}",
            )
        return Decision("retry", 0.0, f"preempted ({n} of {policy.max_preemptions}): {last.cause}")
    if last.outcome is Outcome.HUNG:
        return _after_hang(attempts, policy)
    if last.outcome is Outcome.ROLLED_BACK:
        n = _count(attempts, (Outcome.ROLLED_BACK,))
        if n >= policy.max_rollbacks:
            return Decision(
                "give_up", 0.0, f"gave up after {n} rollbacks (budget {policy.max_rollbacks}): {last.cause}"
            )
        return Decision("retry", 0.0, f"rolled back ({n} of {policy.max_rollbacks}): {last.cause}")
    return _after_error(attempts, policy, rng)


def _after_hang(attempts: list[AttemptRecord], policy: RetryPolicy) -> Decision:
    last = attempts[-1]
    hung = [a for a in attempts if a.outcome is Outcome.HUNG and not a.extra.get("controller_died")]
    here = sum(1 for a in hung if a.last_step == last.last_step)
    if here >= policy.same_error_limit:
        return Decision("give_up", 0.0, f"hung at step {last.last_step} {here} times: {last.cause}")
    if len(hung) >= policy.max_hung:
        return Decision(
            "give_up",
            0.0,
            f"gave up after {len(hung)} hung attempts (budget {policy.max_hung}): {last.cause}",
        )
    return Decision("retry", 0.0, f"hung ({len(hung)} of {policy.max_hung}): {last.cause}")


def _after_error(attempts: list[AttemptRecord], policy: RetryPolicy, rng: random.Random) -> Decision:
    last = attempts[-1]
    error = last.error or last.cause
    if last.outcome is Outcome.CRASHED and last.trainer_code in FATAL_CODES:
        return Decision("give_up", 0.0, f"not retryable ({last.trainer_code}): {error}")
    if last.outcome is Outcome.PROVISION_FAILED and last.extra.get("retryable") is False:
        return Decision("give_up", 0.0, f"cannot provision a worker: {error}")
    repeats = same_error_count(attempts)
    if repeats >= policy.same_error_limit:
        times = "twice" if repeats == 2 else f"{repeats} times"
        return Decision("give_up", 0.0, f"same error at step {last.last_step} {times}: {error}")
    n = _count(attempts, ERROR_OUTCOMES)
    if n >= policy.max_errors:
        return Decision("give_up", 0.0, f"gave up after {n} errors (budget {policy.max_errors}): {error}")
    delay = backoff_delay(n, policy, rng)
    return Decision("retry", delay, f"error {n} of {policy.max_errors}, retrying in {delay:.1f} s: {error}")


def backoff_delay(errors: int, policy: RetryPolicy, rng: random.Random) -> float:
    """Wait after the `errors`-th error: uniform within ±jitter of base·2^(errors-1) capped at the max,
    never above the max (drawn below it rather than clamped, so retries at the cap stay spread)."""
    nominal = min(policy.backoff_max_s, policy.backoff_base_s * 2 ** max(0, errors - 1))
    low = nominal * (1 - policy.jitter)
    return rng.uniform(low, min(policy.backoff_max_s, nominal * (1 + policy.jitter)))


def same_error_count(attempts: list[AttemptRecord]) -> int:
    """How many crashed or lost attempts ended like the last one: same normalized error, same last step."""
    last = attempts[-1]
    if last.outcome not in (Outcome.CRASHED, Outcome.LOST):
        return 0
    key = _error_key(last)
    return sum(1 for a in attempts if a.outcome in (Outcome.CRASHED, Outcome.LOST) and _error_key(a) == key)


def normalize_error(text: str) -> str:
    """Error text with addresses and numbers (pids, sizes, timings) masked; `step N` is kept."""
    return _NUMBER.sub("N", _HEX.sub("0x?", text)).strip()


def _error_key(a: AttemptRecord) -> tuple[str, int]:
    return normalize_error(a.error or a.cause), a.last_step


def _count(attempts: list[AttemptRecord], outcomes: tuple[Outcome, ...]) -> int:
    # An attempt lost with its controller is the controller's failure, not the job's: recover-job's own
    # bound (restarts per job per hour) limits those, so they do not use up the error budget. A move
    # back to spot is the policy's choice, not the market's reclaim: it uses no preemption.
    return sum(1 for a in attempts if a.outcome in outcomes and not _not_counted(a))


def _not_counted(a: AttemptRecord) -> bool:
    """An attempt lost with its controller, or ended by the market policy's own move back to spot."""
    return bool(a.extra.get("controller_died") or a.extra.get(MARKET_MOVE))
