"""Which market the next attempt rents, for a job with a deadline (or a `max_wait_s`): the policy of
tasks/deadlines/policy.py asked at each provisioning, with what SQL measured of the job.

    worker, extra = chooser.provision(lambda market: provider.provision(..., market=market))

The answer is spot, on-demand, or wait. Waiting is not an attempt: the loop sleeps `poll_s` and asks
again (spot is tried again then: a capacity error costs nothing). A spot launch refused for capacity is
not an attempt either: it marks spot unavailable from that moment (the policy's `spot_short_s`, and
`max_wait_s`), and the policy is asked again. What was chosen and why goes to the attempt row's
`extra` (`market`, `market_reason`, `waited_s`) and to an event when the market changes.

Without a deadline and without `max_wait_s` nothing here runs: spot, and a capacity error is the
retry policy's, as before.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Protocol

from spotrun.tasks.control.prewarm import Prewarm
from spotrun.tasks.deadlines.plan import Measured, measure, situation, submission_problem
from spotrun.tasks.deadlines.policy import POLICIES, Decision, Situation
from spotrun.tasks.decisions.attempts import MARKET_MOVE, AttemptRecord, Outcome
from spotrun.tasks.market.prices import Prices
from spotrun.tasks.providers.base import Market, ProvisionError, StopCause, StopWorker, Worker
from spotrun.trainer.spec.deadline import deadline_at
from spotrun.trainer.spec.job import JobSpec

MARKET_CHOSEN = "spotrun.market.chosen"
DEADLINE_AT_RISK = "spotrun.deadline.at-risk"  # even on-demand cannot finish in time (an alert; once a run)
POLL_S = 30.0  # between two looks at a market that has no spot capacity


class Sink(Protocol):
    def log(self, level: int, msg: str) -> None: ...

    def event(
        self, name: str, job: str, payload: dict[str, Any], labels: dict[str, str] | None = None
    ) -> None: ...


@dataclass
class MarketChooser:
    """One job run's market decisions. `start`: when its deadline's clock started (epoch seconds)."""

    job: JobSpec
    history: list[AttemptRecord]  # every attempt of the job in SQL, for the measured rates
    start: float
    sink: Sink
    sleep: Callable[[float], None] = time.sleep
    clock: Callable[[], float] = time.time
    poll_s: float = POLL_S
    short_since: float | None = None  # when spot was last refused for capacity (None: not short)
    last: Decision | None = None  # the decision last announced (an event only when it changes)
    at_risk: bool = False  # DEADLINE_AT_RISK was announced (once per job run)

    @staticmethod
    def wanted(job: JobSpec) -> bool:
        return job.deadline is not None or job.max_wait_s is not None

    def measured(self, records: list[AttemptRecord]) -> Measured:
        return measure(self.job, [*self.history, *records])

    def admit(self, records: list[AttemptRecord], done_step: int, prices: Prices | None) -> str | None:
        """Why the job is refused at submission (one line with the numbers), or None; a warning is
        logged."""
        problem, warning = submission_problem(
            self.job,
            now=self.clock(),
            start=self.start,
            done_step=done_step,
            measured=self.measured(records),
            prices=prices,
        )
        if warning is not None:
            self.sink.log(logging.WARNING, warning)
        return problem

    def decide(self, records: list[AttemptRecord], done_step: int, running: Market | None = None) -> Decision:
        """The policy's answer now. `running`: "on-demand" while an on-demand worker trains (is spot worth
        a move?); spot counts as available then, as a move is tried by provisioning spot ahead."""
        now = self.clock()
        short = 0.0 if self.short_since is None else now - self.short_since
        if (
            running is None
            and self.job.max_wait_s is not None
            and self.short_since is not None
            and short >= self.job.max_wait_s
        ):
            return Decision(
                "on-demand", f"no spot capacity for {short:.0f} s >= max_wait_s {self.job.max_wait_s:g}"
            )
        sit = situation(
            self.job,
            now=now,
            start=self.start,
            done_step=done_step,
            measured=self.measured(records),
            running=running,
            spot_available=running is not None or self.short_since is None,
            preemptions=sum(
                1 for r in records if r.outcome is Outcome.PREEMPTED and not r.extra.get(MARKET_MOVE)
            ),
            spot_short_s=short,
        )
        if sit is not None and sit.slack_s < 0 and not self.at_risk:
            self._at_risk(sit)
        if sit is None:  # no deadline (max_wait_s alone), or no step rate yet
            if running is not None:  # max_wait_s alone: on-demand once chosen stays to the end
                return Decision(running, "no deadline policy: stays")
            return Decision("spot" if self.short_since is None else "wait", "spot (no deadline policy)")
        return POLICIES[self.job.market_policy](sit)

    def provision(
        self, launch: Callable[[Market], Worker], records: list[AttemptRecord], done_step: int
    ) -> tuple[Worker, dict[str, Any]]:
        """Ask, wait or launch until a worker runs; raises the provider's other errors."""
        t0 = self.clock()
        while True:
            decision = self.decide(records, done_step)
            self.note(decision)
            market: Market = "on-demand" if decision.choice == "on-demand" else "spot"
            if decision.choice == "wait":  # then look again: a launch refused for capacity costs nothing
                self.sleep(self.poll_s)
            try:
                worker = launch(market)
            except ProvisionError as e:
                if not e.retryable or market != "spot":
                    raise
                if self.spot_refused():
                    self.sink.log(logging.INFO, f"no spot capacity: {e}")
                continue
            if market == "spot":
                self.short_since = None
            waited = round(self.clock() - t0, 1)
            if decision.choice == "wait":  # the look after the wait found spot
                decision = Decision("spot", f"spot capacity is back after {waited:g} s of waiting")
                self.note(decision)
            return worker, self.row(market, decision.reason, waited)

    def row(self, market: Market, reason: str, waited_s: float = 0.0) -> dict[str, Any]:
        """What an attempt's row says of its market (`extra`)."""
        extra: dict[str, Any] = {"market": market, "market_reason": reason, "waited_s": waited_s}
        if self.job.deadline is not None:  # the report's margin reads it back from the rows
            extra["deadline_at"] = deadline_at(self.job.deadline, self.start)
        return extra

    def _at_risk(self, sit: Situation) -> None:
        """Announce once that the deadline cannot be met any more; the job goes on (on-demand, the
        policies' answer once the slack is gone), finishing late rather than not at all."""
        self.at_risk = True
        due = datetime.fromtimestamp(self.start + sit.deadline_s, UTC).strftime("%Y-%m-%d %H:%M UTC")
        problem = (
            f"{sit.remaining_s / 3600:.2f} h of work left (plus {sit.restart_s:.0f} s to start) and "
            f"{max(sit.left_s, 0) / 3600:.2f} h to the deadline: late by {-sit.slack_s / 3600:.2f} h "
            "even on on-demand"
        )
        self.sink.log(logging.WARNING, f"deadline at risk: {problem}; going on best-effort")
        payload = {"deadline": f"{self.job.deadline} ({due})", "problem": problem}
        self.sink.event(DEADLINE_AT_RISK, self.job.name, payload)

    def replacement(
        self, launch: Callable[[Market], Worker], records: list[AttemptRecord], done_step: int
    ) -> tuple[Worker, str]:
        """The worker started at a spot worker's notice (tasks/control/prewarm.py, in its thread): spot
        elsewhere if there is some, else what the policy says with spot short (on-demand now, rather
        than after the reclaim); raises the refusal when the policy would wait. With the reason."""
        try:
            worker = launch("spot")
            self.short_since = None
            return worker, "prewarmed at the notice"
        except ProvisionError as e:
            if not e.retryable:
                raise
            self.spot_refused()
            decision = self.decide(records, done_step)
            if decision.choice != "on-demand":
                raise
        self.note(decision)
        return launch("on-demand"), f"prewarmed at the notice: {decision.reason}"

    def spot_refused(self) -> bool:
        """A spot launch was refused for capacity: spot is short from now, unless it already was (then
        False: the shortage goes on from its first refusal, as `max_wait_s` counts it)."""
        if self.short_since is not None:
            return False
        self.short_since = self.clock()
        return True

    def note(self, decision: Decision) -> None:
        if self.last is not None and self.last.choice == decision.choice:
            return
        self.last = decision
        self.sink.log(logging.INFO, f"market: {decision.choice} ({decision.reason})")
        payload = {"choice": decision.choice, "reason": decision.reason, "policy": self.job.market_policy}
        self.sink.event(MARKET_CHOSEN, self.job.name, payload)


@dataclass
class BackToSpot:
    """While an on-demand worker trains, ask the policy every `chooser.poll_s` whether spot is worth a
    move; when it is, provision a spot worker ahead (`prewarm`, as at a notice), and once that one
    stands by, end the on-demand attempt (`StopWorker`: the trainer's emergency checkpoint, then the
    lease goes to the spot trainer). A spot launch refused for capacity leaves the job where it is, to
    be asked again a poll later. Called with each step record from the watch (the controller's thread).
    """

    chooser: MarketChooser
    prewarm: Prewarm
    records: list[AttemptRecord]
    args: Callable[[], list[str]]  # the spot trainer's extra arguments
    asked_at: float = float("-inf")
    mine: bool = False  # the prewarm is this move's (else a warm standby started with the attempt)
    off: bool = False  # a spot launch failed for a reason other than capacity: no more tries this attempt

    def on_step(self, durable_step: int) -> None:
        c = self.chooser
        if self.off:
            return
        if self.prewarm.started and self.mine:
            if self.prewarm.ready:
                self._move(self.prewarm.reason)
            error = self.prewarm.failure()
            if error is not None:
                self.mine = False
                self.off = not (isinstance(error, ProvisionError) and error.retryable)
                c.sink.log(logging.INFO, f"staying on on-demand: no spot worker ({error})")
                c.spot_refused()
            return
        now = c.clock()
        if now - self.asked_at < c.poll_s:
            return
        self.asked_at = now
        decision = c.decide(self.records, durable_step, running="on-demand")
        if decision.choice != "spot":
            return
        if self.prewarm.started:  # a warm standby: the move uses it once it stands by on spot
            if self.prewarm.ready and self.prewarm.market == "spot":
                self._move(decision.reason)
            return
        self.mine = True  # announced once its worker stands by
        self.prewarm.start(self.args, reason=decision.reason)

    def _move(self, reason: str) -> None:
        self.chooser.short_since = None
        self.chooser.note(Decision("spot", reason))
        raise StopWorker(StopCause.MARKET, f"moving to spot: {reason}")
