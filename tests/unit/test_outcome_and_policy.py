"""Table tests of the pure attempt decisions: how an attempt ended, when the simulator reclaims a worker,
and whether the flow retries, how soon, or gives up."""

from __future__ import annotations

import random
import signal
from typing import Any

import pytest
from pydantic import ValidationError

from spotrun.tasks.decisions.attempts import AttemptRecord, Outcome
from spotrun.tasks.decisions.outcome import (
    classify,
    last_exception,
    lost_steps,
    productive_seconds,
    provision_failed_record,
    to_record,
)
from spotrun.tasks.decisions.policy import RetryPolicy, backoff_delay, decide, normalize_error
from spotrun.tasks.providers.base import KillReason as KR
from spotrun.tasks.providers.base import NoticeKind as NK
from spotrun.tasks.providers.base import ProvisionError, WatchResult, Worker
from spotrun.tasks.providers.local import (
    PlannedPreemption,
    SpotSimulatorConfig,
    plan_preemption,
    simulator_rng,
)
from spotrun.trainer.telemetry.records import Exit, Started, Stopping

T0 = 1_000_000.0
KILL, TERM = int(signal.SIGKILL), int(signal.SIGTERM)


def _exit(name: str, error: str = "") -> dict[str, Any]:
    return {"exit": Exit(t=T0, code=0, name=name, error=error)}


def _result(**kw: Any) -> WatchResult:
    base: dict[str, Any] = {"started_at": T0, "ended_at": T0 + 10, "started_training_at": T0 + 4}
    return WatchResult(**{**base, **kw})


NOTICE = {"notice_kind": NK.SIM_NOTICE, "notice_at": T0 + 8}
HUNG = {"fired": {"section": "step", "timeout_s": 3.0, "silent_s": 3.08, "source": "attempt", "step": 40}}
CLASSIFY_CASES = [
    # completed marker outranks every exit code and signal
    ("done, exit 0", _result(exit_code=0, **_exit("COMPLETED"), last_step=30), True,
     Outcome.COMPLETED, "completed at step 30"),
    ("done, SIGTERM in teardown", _result(signal=TERM, last_step=30), True,
     Outcome.COMPLETED, "completed at step 30 (then killed by SIGTERM)"),
    ("done, torchrun rc 1", _result(exit_code=1), True, Outcome.COMPLETED, "(then exit code 1)"),
    ("lost in training", _result(signal=KILL, lost=True, silent_s=3.04, last_step=20, kill_reason=KR.LOST),
     False, Outcome.LOST, "no heartbeat for 3 s (after step 20); worker killed"),
    ("lost in start-up", _result(signal=KILL, lost=True, silent_s=600, started_training_at=None), False,
     Outcome.LOST, "did not start training within 600 s; worker killed"),
    ("notice, clean exit", _result(exit_code=75, **_exit("PREEMPTED"), ended_at=T0 + 8.8, **NOTICE),
     False, Outcome.PREEMPTED, "spot notice, exited PREEMPTED after 0.8 s"),
    ("notice, window expired",
     _result(signal=KILL, kill_reason=KR.NOTICE_WINDOW, killed_at=T0 + 13, ended_at=T0 + 13.1, **NOTICE),
     False, Outcome.PREEMPTED, "spot notice, killed after the 5 s window"),
    ("notice, crash while stopping", _result(exit_code=1, **_exit("CRASHED", "OSError: disk"), **NOTICE),
     False, Outcome.PREEMPTED, "spot notice, then exited CRASHED after 2 s: OSError: disk"),
    ("notice, but diverged",
     _result(exit_code=3, **_exit("DIVERGED", "TrainingDiverged: nan"), **NOTICE), False,
     Outcome.CRASHED, "exited DIVERGED: TrainingDiverged: nan"),
    ("no-notice reclaim", _result(signal=KILL, notice_kind=NK.SIM_NO_NOTICE, kill_reason=KR.NO_NOTICE), False,
     Outcome.PREEMPTED, "reclaimed without notice (SIGKILL)"),
    ("SIGKILL nobody sent", _result(signal=KILL), False,
     Outcome.CRASHED, "killed by SIGKILL (out of memory?)"),
    ("SIGSEGV", _result(signal=int(signal.SIGSEGV)), False, Outcome.CRASHED, "killed by SIGSEGV"),
    ("user SIGTERM",
     _result(exit_code=75, **_exit("PREEMPTED"), stopping=Stopping(t=T0, reason="SIGTERM", step=5)),
     False, Outcome.PREEMPTED, "stopped on SIGTERM (no simulator notice), exited PREEMPTED"),
    ("--max-steps", _result(exit_code=4, **_exit("STOPPED"), last_step=13), False,
     Outcome.PREEMPTED, "stopped at --max-steps (step 13)"),
    ("crash", _result(exit_code=1, **_exit("CRASHED", "RuntimeError: injected crash at step 30")), False,
     Outcome.CRASHED, "exited CRASHED: RuntimeError: injected crash at step 30"),
    ("config error", _result(exit_code=2, **_exit("CONFIG_ERROR", "ConfigError: bad\nmore")), False,
     Outcome.CRASHED, "exited CONFIG_ERROR: ConfigError: bad"),
    ("exit 0, no marker", _result(exit_code=0, **_exit("COMPLETED")), False,
     Outcome.CRASHED, "exited COMPLETED but COMPLETED.json is missing"),
    ("died before reporting", _result(exit_code=1, log_tail="Traceback:\n  x\nImportError: no torch"), False,
     Outcome.CRASHED, "exited with code 1 before reporting: ImportError: no torch"),
    ("released mid-run", _result(signal=KILL, kill_reason=KR.RELEASE), False,
     Outcome.CRASHED, "killed by release() while running"),
    ("hung step", _result(signal=KILL, kill_reason=KR.RELEASE, hung=HUNG), False,
     Outcome.HUNG,
     "hung: no step after step 40 for 3.1 s (step timeout 3 s, from the attempt); worker killed"),
    ("hung, then the heartbeat too", _result(signal=KILL, hung=HUNG, lost=True, silent_s=3.2), False,
     Outcome.HUNG, "hung: no step after step 40"),
    ("hung, yet completed", _result(signal=KILL, hung=HUNG, last_step=40), True,
     Outcome.COMPLETED, "completed"),
]  # fmt: skip  # a decision table, one case per row


@pytest.mark.parametrize(
    ("result", "completed", "outcome", "cause"),
    [c[1:] for c in CLASSIFY_CASES],
    ids=[c[0] for c in CLASSIFY_CASES],
)
def test_classify(result: WatchResult, completed: bool, outcome: Outcome, cause: str) -> None:
    got, text = classify(result, completed)
    assert got is outcome
    assert cause in text and "\n" not in text


@pytest.mark.parametrize(
    ("schedule", "mean", "attempt", "expect"),
    [
        ([], None, 1, None),
        ([PlannedPreemption(after_s=2)], None, 1, PlannedPreemption(after_s=2, notice=True)),
        ([PlannedPreemption(after_s=2), PlannedPreemption(after_s=0, notice=False)], None, 2,
         PlannedPreemption(after_s=0, notice=False)),
        ([PlannedPreemption(after_s=2)], None, 2, None),  # schedule exhausted, no random reclaims
        ([PlannedPreemption(after_s=2)], 30.0, 2, "random"),  # then random ones
        ([], 30.0, 1, "random"),
    ],
)  # fmt: skip  # a decision table, one case per row
def test_plan_preemption(
    schedule: list[PlannedPreemption], mean: float | None, attempt: int, expect: Any
) -> None:
    cfg = SpotSimulatorConfig(schedule=schedule, mean_interval_s=mean)
    plan = plan_preemption(cfg, attempt, simulator_rng(cfg.seed, attempt))
    if expect == "random":
        assert plan is not None and plan.after_s > 0
        assert plan == plan_preemption(cfg, attempt, simulator_rng(cfg.seed, attempt))  # seeded per attempt
    else:
        assert plan == expect


def test_random_reclaims_follow_the_mean_and_the_no_notice_share() -> None:
    cfg = SpotSimulatorConfig(seed=3, mean_interval_s=60, no_notice_fraction=0.25)
    plans = [plan_preemption(cfg, a, simulator_rng(cfg.seed, a)) for a in range(1, 2001)]
    afters = [p.after_s for p in plans if p is not None]
    assert 54 < sum(afters) / len(afters) < 66
    assert 0.2 < sum(1 for p in plans if p is not None and not p.notice) / len(plans) < 0.3


def test_simulator_config_rejects_bad_values() -> None:
    with pytest.raises(ValidationError, match="no_notice_fraction"):
        SpotSimulatorConfig(no_notice_fraction=1.5)
    with pytest.raises(ValidationError, match="extra"):
        SpotSimulatorConfig.model_validate({"mean_interval": 5})


def test_accounting_lost_steps_and_productive_time() -> None:
    r = _result(
        started_training_at=T0 + 4,
        started=Started(t=T0 + 4, step=20, resumed_from=20),
        last_step=47,
        last_durable_step=40,
        step_times=[(T0 + 4, 20), (T0 + 5, 30), (T0 + 6, 50)],
        durable_times=[(T0 + 7, 40)],
    )
    assert lost_steps(r, 40) == 7 and lost_steps(r, None) == 7 and lost_steps(r, 60) == 0
    assert productive_seconds(r) == pytest.approx(1.5)  # step 40 reached halfway from 30 (t+5) to 50 (t+6)
    assert productive_seconds(_result(last_durable_step=None)) == 0.0
    beyond = _result(
        last_durable_step=40, step_times=[(T0 + 4, 0), (T0 + 5, 30)], durable_times=[(T0 + 7, 40)]
    )
    assert productive_seconds(beyond) == pytest.approx(3.0)  # no sample that far: the durable time


def test_to_record_and_provision_failed_record() -> None:
    worker = Worker("local-1", "local", 2, T0)
    r = _result(exit_code=1, **_exit("CRASHED", "RuntimeError: boom"), last_step=33, last_durable_step=28)
    outcome, cause = classify(r, False)
    rec = to_record(worker, r, outcome, cause, resumed_checkpoint="s3://b/j/step_000000028")
    assert (rec.attempt, rec.worker_id, rec.outcome, rec.error) == (
        2,
        "local-1",
        Outcome.CRASHED,
        "RuntimeError: boom",
    )
    assert (rec.lost_steps, rec.wall_s, rec.trainer_code, rec.exit_code) == (5, 10, "CRASHED", 1)
    assert rec.to_row()["outcome"] == "crashed"
    lost = _result(signal=KILL, lost=True, silent_s=3)
    lost_rec = to_record(worker, lost, *classify(lost, False))
    assert lost_rec.error == lost_rec.cause  # what the same-error rule compares
    failed = provision_failed_record(
        3, "local", ProvisionError("no capacity", retryable=True), started_at=T0, ended_at=T0 + 1
    )
    assert failed.outcome is Outcome.PROVISION_FAILED and failed.extra == {"retryable": True}


def test_last_exception_line() -> None:
    assert last_exception("x\nValueError: a\n2026 INFO ok\ntorch.OutOfMemoryError: CUDA out\n") == (
        "torch.OutOfMemoryError: CUDA out"
    )
    assert last_exception("INFO all fine\n") == ""


def _rec(
    outcome: Outcome, error: str = "", step: int = 0, code: str | None = None, **extra: Any
) -> AttemptRecord:
    return AttemptRecord(
        attempt=0,
        worker_id="w",
        provider="local",
        started_at=T0,
        ended_at=T0,
        outcome=outcome,
        cause=f"cause of {outcome.value}",
        error=error,
        last_step=step,
        trainer_code=code,
        extra=extra,
    )


P, C, L, F, H = Outcome.PREEMPTED, Outcome.CRASHED, Outcome.LOST, Outcome.PROVISION_FAILED, Outcome.HUNG
CRASH30 = "RuntimeError: injected crash at step 30"
DECIDE_CASES = [
    ("first attempt", [], "retry", "first attempt"),
    ("completed", [_rec(P), _rec(Outcome.COMPLETED, step=100)], "done", "completed at step 100 in 2"),
    ("preempted", [_rec(P)], "retry", "preempted (1 of 3)"),
    ("preemption budget", [_rec(P)] * 3, "give_up", "gave up after 3 preemptions (budget 3)"),
    ("preemptions don't use the error budget", [_rec(C, "a", 1), _rec(C, "b", 2), _rec(P)],
     "retry", "preempted"),
    ("config error", [_rec(C, "ConfigError: bad", code="CONFIG_ERROR")], "give_up",
     "not retryable (CONFIG_ERROR): ConfigError: bad"),
    ("diverged", [_rec(C, "TrainingDiverged: nan", code="DIVERGED")], "give_up", "not retryable (DIVERGED)"),
    ("crash", [_rec(C, CRASH30, 28, "CRASHED")], "retry", "error 1 of 3"),
    ("error budget", [_rec(C, "a", 1), _rec(L, "b", 2), _rec(C, CRASH30, 30)], "give_up",
     f"gave up after 3 errors (budget 3): {CRASH30}"),
    ("provision failures count", [_rec(F, "no capacity", retryable=True)] * 3,
     "give_up", "gave up after 3 errors"),
    ("provision failures are not 'the same error'", [_rec(F, "no capacity", retryable=True)] * 2, "retry",
     "error 2 of 3"),
    ("unretryable provision", [_rec(F, "no python", retryable=False)], "give_up",
     "cannot provision a worker: no python"),
    ("same error, same step", [_rec(C, CRASH30, 30), _rec(P), _rec(C, CRASH30, 30)], "give_up",
     f"same error at step 30 twice: {CRASH30}"),
    ("same error, other pid", [_rec(C, "worker (pid 12) died", 7), _rec(C, "worker (pid 99) died", 7)],
     "give_up", "same error at step 7 twice"),
    ("same error, other step", [_rec(C, "OOM", 30), _rec(C, "OOM", 31)], "retry", "error 2 of 3"),
    ("same hang, same step", [_rec(L, "no heartbeat for 3 s", 20), _rec(L, "no heartbeat for 3.1 s", 20)],
     "give_up", "same error at step 20 twice"),
    ("hung: at once", [_rec(H, step=40)], "retry", "hung (1 of 2)"),
    ("hung uses its own budget", [_rec(C, "a", 1), _rec(C, "b", 2), _rec(H, step=40)], "retry",
     "hung (1 of 2)"),
    ("hung budget", [_rec(H, step=40), _rec(H, step=90)], "give_up",
     "gave up after 2 hung attempts (budget 2)"),
    ("hung twice at one step", [_rec(H, step=40), _rec(P), _rec(H, step=40)], "give_up",
     "hung at step 40 2 times"),
    ("hung does not use the error budget", [_rec(H, step=4), _rec(C, "a", 1), _rec(C, "b", 2)], "retry",
     "error 2 of 3"),
]  # fmt: skip  # a decision table, one case per row


@pytest.mark.parametrize(
    ("attempts", "action", "reason"), [c[1:] for c in DECIDE_CASES], ids=[c[0] for c in DECIDE_CASES]
)
def test_decide(attempts: list[AttemptRecord], action: str, reason: str) -> None:
    policy = RetryPolicy(max_preemptions=3, max_errors=3, max_hung=2)
    d = decide(attempts, policy, random.Random(0))
    assert (d.action, reason in d.reason) == (action, True), d.reason
    assert "\n" not in d.reason
    if action == "retry" and attempts and attempts[-1].outcome in (P, H):
        assert d.delay_s == 0.0  # a fresh worker at once
    if action != "retry":
        assert d.delay_s == 0.0


@pytest.mark.parametrize("errors", [1, 2, 3, 5, 8, 20])
def test_backoff_stays_within_jitter_of_the_capped_exponential(errors: int) -> None:
    policy = RetryPolicy(backoff_base_s=1, backoff_max_s=30, jitter=0.5)
    nominal = min(30, 2 ** (errors - 1))
    rng = random.Random(42)
    delays = [backoff_delay(errors, policy, rng) for _ in range(500)]
    assert all(0.5 * nominal <= d <= min(30, 1.5 * nominal) for d in delays)
    assert max(delays) - min(delays) > 0.4 * nominal  # spread, also at the cap
    assert sum(d == 30 for d in delays) < 5  # drawn below the cap, not clamped onto it


def test_error_retry_waits_with_backoff_and_is_reproducible() -> None:
    policy = RetryPolicy(backoff_base_s=2, backoff_max_s=60, jitter=0.0, max_errors=5)
    attempts = [_rec(C, "a", 1), _rec(C, "b", 2), _rec(C, "c", 3)]
    assert decide(attempts, policy, random.Random(1)).delay_s == 8.0
    jittery = policy.model_copy(update={"jitter": 0.5})
    assert decide(attempts, jittery, random.Random(7)) == decide(attempts, jittery, random.Random(7))


def test_retry_policy_validation() -> None:
    with pytest.raises(ValidationError, match="raise backoff_max_s"):
        RetryPolicy(backoff_base_s=10, backoff_max_s=5)
    with pytest.raises(ValidationError, match="same_error_limit"):
        RetryPolicy(same_error_limit=1)
    with pytest.raises(ValidationError, match="max_hung"):
        RetryPolicy(max_hung=0)
    with pytest.raises(ValidationError, match="extra"):
        RetryPolicy.model_validate({"heartbeat_timeout_s": 60})


def test_normalize_error_masks_numbers_but_keeps_the_step() -> None:
    assert normalize_error("worker (pid 4242) at 0x7f3a: 12.5 MiB at step 30") == (
        "worker (pid N) at 0x?: N MiB at step 30"
    )


def test_summary_compares_cost_with_on_demand() -> None:
    """The flow's summary carries the goodput report's figures (tasks/reports/goodput.py), cost included."""
    from spotrun.tasks.reports.goodput import RunInfo, compute
    from spotrun.tasks.reports.reporting import summary_markdown

    def rec(attempt: int, cost: dict[str, Any] | None) -> AttemptRecord:
        r = AttemptRecord(
            attempt,
            f"i-{attempt}",
            "aws",
            started_at=0.0,
            ended_at=1.0,
            outcome=Outcome.PREEMPTED,
            cause="spot",
        )
        if cost is not None:
            r.extra["cost"] = cost
        return r

    def md(*records: AttemptRecord) -> str:
        rep = compute(list(records), RunInfo("j", "run-1", "failed", 2.0), now=2.0)
        return summary_markdown("j", "failed", list(records), rep=rep, timeline="")

    spot = {"usd": 0.3, "on_demand_usd": 1.0, "hours": 1.0, "market": "spot", "price_per_h": 0.3}
    assert "| cost | $0.60 spot vs $2.00 on demand (70% saved) |" in md(rec(1, spot), rec(2, spot))
    assert "| cost | n/a |" in md(rec(1, None)) or "| cost | unavailable |" in md(rec(1, None))
    unknown = md(rec(1, {**spot, "usd": None}))  # a price unknown: no made-up total
    assert "| cost | unavailable vs $1.00 on demand |" in unknown
