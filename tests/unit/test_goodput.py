"""Table tests of the goodput report: fixed histories -> the numbers, computed by hand below.

The main history (`HISTORY`, also loaded into real databases by tests/integration/test_report_cmd.py):
a 300-step job, five attempts, times in seconds after T.

  #  outcome           start  training  ended  resumed  durable  last  productive_s  extra
  1  preempted             0        20     90        -      100   130   50 (0.5 s/step)
  2  provision_failed     95         -    125        -        -     0    0
  3  crashed             130       160    250      100      200   240   60 (0.6 s/step)  every: auto T=20 C=2
  4  lost                260       280    330      150        -   170    0
  5  completed           340       350    430      150      300   300   75 (0.5 s/step)

Attempt 3's checkpoint at 200 was refused: attempts 4 and 5 resumed from 150. The job run ended at 440.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from spotrun.tasks.decisions.attempts import AttemptRecord, Outcome
from spotrun.tasks.reports.goodput import GoodputReport, RunInfo, compute, markdown, progress, summary_rows

T = 1_700_000_000.0  # whole seconds after it survive the SQL datetime round trip exactly
JOB, RUN = "digits", "11111111-2222-3333-4444-555555555555"


def cost(usd: float | None, on_demand: float | None) -> dict[str, Any]:
    return {"usd": usd, "on_demand_usd": on_demand, "hours": 0.01, "market": "spot"}


def attempt(
    n: int,
    outcome: Outcome,
    start: float,
    ended: float,
    *,
    trained: float | None = None,
    resumed: int | None = None,
    durable: int | None = None,
    last: int = 0,
    productive: float = 0.0,
    **extra: Any,
) -> AttemptRecord:
    facts: dict[str, Any] = {"total_steps": 300, **extra}
    if trained is not None:
        facts["started_training_at"] = T + trained
    return AttemptRecord(
        attempt=n,
        worker_id=f"local-{n}",
        provider="local",
        started_at=T + start,
        ended_at=T + ended,
        outcome=outcome,
        cause=outcome.value,
        resumed_from=resumed,
        last_step=last,
        last_durable_step=durable,
        productive_s=productive,
        wall_s=ended - start,
        extra=facts,
    )


HISTORY = [
    attempt(1, Outcome.PREEMPTED, 0, 90, trained=20, durable=100, last=130, productive=50.0,
            cost=cost(0.10, 0.40)),
    attempt(2, Outcome.PROVISION_FAILED, 95, 125, retryable=True),
    attempt(3, Outcome.CRASHED, 130, 250, trained=160, resumed=100, durable=200, last=240, productive=60.0,
            cost=cost(0.12, 0.48), checkpoint_interval={"seconds": 20.0, "cost_s": 2.0, "mtbf_s": 200.0}),
    attempt(4, Outcome.LOST, 260, 330, trained=280, resumed=150, last=170, cost=cost(0.08, 0.32)),
    attempt(5, Outcome.COMPLETED, 340, 430, trained=350, resumed=150, durable=300, last=300, productive=75.0,
            cost=cost(0.20, 0.80)),
]  # fmt: skip  # a decision table, one case per row
ENDED = T + 440
DONE = RunInfo(JOB, RUN, "completed", ENDED)

# Seconds per step pooled over the attempts with durable progress (1, 3, 5), used for attempt 4:
POOLED = (50 + 60 + 75) / ((100 - 0) + (200 - 100) + (300 - 150))  # 185 / 350 s per step

# The whole report of HISTORY, by hand:
EXPECTED: dict[str, Any] = dict(
    wall_s=440 - 0,  # first attempt's start (T+0) -> the job run's end (T+440)
    wall_end="job end",
    # ETT: attempt 1 kept 0..100 (productive_s 50); 3 kept 100..150 of its 100..200 (150 was resumed
    # from next) at 0.6 s/step; 4 kept nothing; 5 kept 150..300 (productive_s 75); 2 trained nothing.
    effective_s=50 + (150 - 100) * 0.6 + 75,  # = 155
    goodput=(50 + 30 + 75) / 440,  # = 0.3523
    final_step=300,
    total_steps=300,
    lost_steps=(130 - 100) + (240 - 150) + (170 - 150),  # preempted 30 + crashed 90 + lost 20 = 140
    lost_gpu_s=30 * 0.5 + 90 * 0.6 + 20 * POOLED,  # 15 + 54 + 10.571 (1 GPU per worker)
    gpus_per_worker=1,
    recoveries=3,
    # Recovery: from the previous attempt with a worker's end to this one's `started` record:
    # 3: 90 -> 160 (over the provision failure), 4: 250 -> 280, 5: 330 -> 350.
    recovery_s=(160 - 90) + (280 - 250) + (350 - 330),  # 70 + 30 + 20 = 120
    recovery_max_s=160 - 90,
    # Only attempt 3 stored its checkpoint cost: 90 s of training (160 -> 250), C=2 s every T=20 s.
    checkpoint_overhead_s=(250 - 160) * 2.0 / (20.0 + 2.0),  # = 8.18
    cost_usd=0.10 + 0.12 + 0.08 + 0.20,  # = 0.50
    on_demand_usd=0.40 + 0.48 + 0.32 + 0.80,  # = 2.00
    saved=1 - 0.50 / 2.00,  # = 0.75
)
EXPECTED_CAUSES = [  # (cause, attempts, lost steps, lost GPU-seconds), sorted by cause
    ("crashed", 1, 240 - 150, 90 * 0.6),
    ("lost", 1, 170 - 150, 20 * POOLED),
    ("preempted", 1, 130 - 100, 30 * 0.5),
    ("provision_failed", 1, 0, 0.0),
]
EXPECTED_ATTEMPTS = [  # (attempt, start step, kept step, lost steps, s/step, from, recovery s, to)
    (1, 0, 100, 30, 50 / 100, "attempt", None, ""),
    (2, 100, 100, 0, None, "", None, ""),  # no worker: no steps, no recovery of its own
    (3, 100, 150, 90, 60 / 100, "attempt", 160 - 90, "first step"),
    (4, 150, 150, 20, POOLED, "job run", 280 - 250, "first step"),
    (5, 150, 300, 0, 75 / 150, "attempt", 350 - 330, "first step"),
]


def check(rep: GoodputReport, expected: dict[str, Any]) -> None:
    for key, want in expected.items():
        got = getattr(rep, key)
        assert got == (pytest.approx(want) if isinstance(want, float) else want), key


def test_the_fixed_history_by_hand() -> None:
    rep = compute(HISTORY, DONE, now=ENDED + 1000)
    check(rep, EXPECTED)
    causes = [(c.cause, c.attempts, c.lost_steps, c.lost_gpu_s) for c in rep.lost_by_cause]
    assert causes == [(c, n, s, pytest.approx(g)) for c, n, s, g in EXPECTED_CAUSES]
    rows = [
        (
            f.attempt,
            f.start_step,
            f.kept_step,
            f.lost_steps,
            f.s_per_step,
            f.s_per_step_from,
            f.recovery_s,
            f.recovery_to,
        )
        for f in rep.attempts
    ]
    assert rows == [
        (
            a,
            s,
            k,
            lost,
            None if sps is None else pytest.approx(sps),
            f,
            None if r is None else pytest.approx(r),
            t,
        )
        for a, s, k, lost, sps, f, r, t in EXPECTED_ATTEMPTS
    ]
    assert rep.attempts[0].effective_s == 50.0  # exactly productive_s when the durable step is the one kept
    assert rep.unavailable == {}
    assert rep.notes == [
        "GPUs per worker: 1 assumed: the job spec is not stored in SQL (only its hash)",
        "attempt 4: seconds per step pooled over the job run (no durable progress)",
        "checkpoint overhead estimated from the `every: auto` choice: training time x C / (T + C)",
        "checkpoint overhead leaves out attempt(s) 1, 4, 5: no cost per checkpoint stored",
    ]


def without(rows: list[AttemptRecord], *keys: str) -> list[AttemptRecord]:
    return [replace(r, extra={k: v for k, v in r.extra.items() if k not in keys}) for r in rows]


# (name, attempts, run, now, expected figures, expected unavailable keys)
CASES: list[tuple[str, list[AttemptRecord], RunInfo, float, dict[str, Any], set[str]]] = [
    (
        "the spec known: 4 GPUs per worker",
        HISTORY,
        replace(DONE, gpus_per_worker=4),
        ENDED,
        {"gpus_per_worker": 4, "lost_gpu_s": 4 * (30 * 0.5 + 90 * 0.6 + 20 * POOLED)},
        set(),
    ),
    (
        "still running: wall time to now",
        HISTORY[:3],
        RunInfo(JOB, RUN, "running", None),
        T + 300,
        {
            "wall_s": 300 - 0,
            "wall_end": "now",
            # attempt 3 has no next attempt yet: it keeps its durable 200 (productive_s 60)
            "effective_s": 50 + 60,
            "goodput": (50 + 60) / 300,
            "lost_steps": (130 - 100) + (240 - 200),
        },
        set(),
    ),
    (
        "controller died, no end: wall time to the last attempt's end",
        HISTORY[:4],
        RunInfo(JOB, RUN, "crashed", None),
        T + 10_000,
        {
            "wall_s": 330 - 0,
            "wall_end": "last attempt end",
            # attempt 4 lost everything (20 steps at the pooled 110/200 s per step of attempts 1 and 3)
            "effective_s": 50 + (150 - 100) * 0.6,
            "lost_gpu_s": 30 * 0.5 + 90 * 0.6 + 20 * (50 + 60) / (100 + 100),
        },
        set(),
    ),
    (
        "no `started` records (older rows): recovery to the attempt's start",
        without(HISTORY, "started_training_at"),
        DONE,
        ENDED,
        {
            "recovery_s": (130 - 90) + (260 - 250) + (340 - 330),  # 40 + 10 + 10
            "checkpoint_overhead_s": None,  # needs the training time, from the `started` record
            "effective_s": 50 + 30 + 75,
        },
        {"checkpoint_overhead_s"},
    ),
    (
        "unpriced and fixed-interval attempts (the local simulator)",
        without(HISTORY, "cost", "checkpoint_interval"),
        DONE,
        ENDED,
        {"cost_usd": None, "on_demand_usd": None, "saved": None, "checkpoint_overhead_s": None},
        {"cost_usd", "on_demand_usd", "checkpoint_overhead_s"},
    ),
    (
        "spot price unknown for one attempt",
        [*HISTORY[:4], replace(HISTORY[4], extra={**HISTORY[4].extra, "cost": cost(None, 0.80)})],
        DONE,
        ENDED,
        {"cost_usd": None, "on_demand_usd": 0.40 + 0.48 + 0.32 + 0.80, "saved": None},
        {"cost_usd"},
    ),
    (
        "no attempt recorded yet",
        [],
        RunInfo(JOB, RUN, "running", None),
        T,
        {"wall_s": 0.0, "effective_s": None, "goodput": None, "lost_steps": 0, "recovery_s": None},
        {"effective_s", "goodput", "cost_usd", "on_demand_usd", "checkpoint_overhead_s"},
    ),
    (
        "a lone lost attempt with no timing at all: lost GPU-seconds unknown",
        [attempt(1, Outcome.LOST, 0, 50, last=40, controller_died=True)],
        RunInfo(JOB, RUN, "failed", T + 60),
        T + 60,
        {"wall_s": 60 - 0, "effective_s": 0.0, "goodput": 0.0, "lost_steps": 40 - 0, "lost_gpu_s": None},
        {"lost_gpu_s", "cost_usd", "on_demand_usd", "checkpoint_overhead_s"},
    ),
    (
        "only an upper bound: training time to the attempt's end over its steps",
        [attempt(1, Outcome.PREEMPTED, 0, 50, trained=10, last=20)],
        RunInfo(JOB, RUN, "failed", T + 50),
        T + 50,
        {"lost_steps": 20, "lost_gpu_s": 20 * (50 - 10) / (20 - 0)},  # 40 s for 20 steps: 2 s/step
        {"cost_usd", "on_demand_usd", "checkpoint_overhead_s"},
    ),
]


@pytest.mark.parametrize(
    ("attempts", "run", "now", "expected", "missing"), [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_cases(
    attempts: list[AttemptRecord], run: RunInfo, now: float, expected: dict[str, Any], missing: set[str]
) -> None:
    rep = compute(attempts, run, now)
    check(rep, expected)
    assert set(rep.unavailable) == missing
    for key in missing:  # a missing figure is None and says why
        assert getattr(rep, key) is None and rep.unavailable[key]


def test_order_of_the_rows_does_not_matter() -> None:
    assert compute(list(reversed(HISTORY)), DONE, ENDED) == compute(HISTORY, DONE, ENDED)


def test_summary_rows_and_markdown_name_what_is_unavailable() -> None:
    rep = compute(without(HISTORY, "cost"), DONE, ENDED)
    rows = dict(summary_rows(rep))
    assert rows["goodput"] == "35.2%"  # 155 / 440
    assert rows["lost steps"] == "140 (crashed 90, lost 20, preempted 30)"
    assert rows["recovery"] == "3 x, mean 40.0 s, max 70.0 s"  # 120 / 3
    assert rows["cost"] == "unavailable"
    md = markdown(rep)
    assert "| goodput | 35.2% |" in md and "| crashed | 1 | 90 | 54.0 |" in md
    assert "- unavailable: cost_usd: no attempt row carries a price" in md


def test_progress_lines_for_the_plot() -> None:
    rep = compute(HISTORY, DONE, ENDED)
    lines = {p.attempt: p for p in progress(HISTORY, rep)}
    # attempt 1: from its `started` record (20) at 0.5 s/step: step 100 kept at 20 + 50, step 130 at 20 + 65
    assert lines[1].points == [(T + 20, 0), (T + 20 + 100 * 0.5, 100), (T + 20 + 130 * 0.5, 130)]
    assert lines[2].points == []  # no worker, no steps
    # attempt 3: kept 150 at 160 + 50 * 0.6; its last step 240 would be at 160 + 84 (before its end, 250)
    assert lines[3].points == [(T + 160, 100), (T + 160 + 50 * 0.6, 150), (T + 160 + 140 * 0.6, 240)]
    assert (lines[3].kept_step, lines[3].start_step) == (150, 100)
    assert lines[5].points == [(T + 350, 150), (T + 350 + 150 * 0.5, 300)]


@pytest.mark.parametrize(
    ("deadline", "run", "row"),
    [
        (None, DONE, None),  # no deadline: no row
        (ENDED + 4320, DONE, "met with 1.20 h to spare"),
        (ENDED - 1080, DONE, "missed by 0.30 h"),
        (T + 3600 + 500, RunInfo(JOB, RUN, "running", None), "1.00 h left"),  # now = T + 500
    ],
)
def test_the_deadline_margin_from_the_attempts_market_decisions(
    deadline: float | None, run: RunInfo, row: str | None
) -> None:
    rows = [replace(r, extra={**r.extra, **({"deadline_at": deadline} if deadline else {})}) for r in HISTORY]
    rep = compute(rows, run, now=T + 500)
    assert dict(summary_rows(rep)).get("deadline") == row


def test_warm_standbys_are_reported_apart_and_their_price_counts_in_the_cost() -> None:
    warm = {"warm": {"standby_s": 1800.0, "usd": 0.5, "idle_s": None}}
    rows = [replace(r, extra={**r.extra, **warm}) if r.attempt == 1 else r for r in HISTORY]
    plain, rep = compute(HISTORY, DONE, ENDED), compute(rows, DONE, ENDED)
    assert (rep.warm_standby_s, rep.warm_usd) == (1800.0, 0.5)
    assert plain.cost_usd is not None and rep.cost_usd == pytest.approx(plain.cost_usd + 0.5)
    assert dict(summary_rows(rep))["warm standby"] == "1800.0 s, $0.50 (in the cost)"
    assert "warm standby" not in dict(summary_rows(plain))
    unpriced = [replace(r, extra={**r.extra, "warm": {"standby_s": 60.0, "usd": None}}) for r in HISTORY]
    assert compute(unpriced, DONE, ENDED).warm_usd is None
