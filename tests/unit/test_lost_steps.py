"""Table tests of the one lost-steps rule (tasks/decisions/lost_steps.py) and of the run walk the report and
the attempts table both use."""

from __future__ import annotations

import pytest

from spotrun.tasks.decisions.attempts import AttemptRecord, Outcome
from spotrun.tasks.decisions.lost_steps import kept_step, known_start, lost_steps, walk

T = 1_700_000_000.0

# (case, last, start, durable, next start, completed) -> (kept, lost)
RULE = [
    ("completed: nothing lost", 300, 150, 300, None, True, 300, 0),
    ("completed past its last durable step", 300, 150, 250, None, True, 300, 0),
    ("notice: emergency checkpoint at the last step", 130, 100, 130, 130, False, 130, 0),
    ("SIGKILL: steps past the durable checkpoint", 130, 0, 100, 100, False, 100, 30),
    ("next not known yet: the durable step", 130, 0, 100, None, False, 100, 30),
    ("newest checkpoint refused: the next resumed earlier", 240, 100, 200, 150, False, 150, 90),
    (
        "the next resumed past the durable report: a checkpoint it did not report",
        130,
        0,
        100,
        120,
        False,
        120,
        10,
    ),
    ("no durable step: all since its start", 170, 150, None, 150, False, 150, 20),
    ("no durable step, next not known", 170, 150, None, None, False, 150, 20),
    ("the next resumed before this attempt's start: only its own steps", 170, 150, 160, 100, False, 150, 20),
    ("the next resumed from scratch", 50, 0, 40, 0, False, 0, 50),
    ("never trained past its start", 0, 100, None, 100, False, 100, 0),
    ("the next beyond its last reported step", 47, 20, 40, 60, False, 47, 0),
    ("a durable step beyond the last reported one", 40, 0, 50, None, False, 40, 0),
]


@pytest.mark.parametrize(
    ("last", "start", "durable", "nxt", "completed", "kept", "lost"),
    [c[1:] for c in RULE],
    ids=[c[0] for c in RULE],
)
def test_the_rule(
    last: int, start: int, durable: int | None, nxt: int | None, completed: bool, kept: int, lost: int
) -> None:
    got = kept_step(last, start=start, durable=durable, next_start=nxt, completed=completed)
    assert (got, lost_steps(last, got)) == (kept, lost)


def row(
    n: int,
    outcome: Outcome,
    *,
    resumed: int | None = None,
    trained: bool = True,
    durable: int | None = None,
    last: int = 0,
) -> AttemptRecord:
    extra = {"started_training_at": T + n} if trained else {}
    return AttemptRecord(
        attempt=n,
        worker_id=f"w{n}",
        provider="local",
        started_at=T + n,
        ended_at=T + n + 1,
        outcome=outcome,
        cause="",
        resumed_from=resumed,
        last_step=last,
        last_durable_step=durable,
        extra=extra,
    )


def test_known_start() -> None:
    assert known_start(row(1, Outcome.CRASHED, resumed=40)) == 40
    assert known_start(row(1, Outcome.CRASHED)) == 0  # a `started` record without a resume: scratch
    assert known_start(row(1, Outcome.LOST, trained=False)) is None  # never said


# (case, rows, next start) -> (starts, kept)
WALK = [
    ("no attempts", [], None, [], []),
    (
        "refused checkpoint, provision failure skipped, lost worker that never said where it started",
        [
            row(1, Outcome.PREEMPTED, durable=100, last=130),
            row(2, Outcome.PROVISION_FAILED, trained=False),
            row(3, Outcome.CRASHED, resumed=100, durable=200, last=240),
            row(4, Outcome.LOST, trained=False, last=170),
            row(5, Outcome.COMPLETED, resumed=150, durable=300, last=300),
        ],
        None,
        [0, 100, 100, 200, 150],
        [100, 100, 200, 200, 300],
    ),
    (
        "the flow's estimate for the attempt after the last row",
        [
            row(1, Outcome.PREEMPTED, durable=100, last=130),
            row(2, Outcome.CRASHED, resumed=100, durable=200, last=240),
        ],
        150,
        [0, 100],
        [100, 150],
    ),
    (
        "the estimate is passed over a provision failure, which starts where the kept work ended",
        [row(1, Outcome.CRASHED, durable=100, last=130), row(2, Outcome.PROVISION_FAILED, trained=False)],
        50,
        [0, 50],
        [50, 50],
    ),
]


@pytest.mark.parametrize(("rows", "nxt", "starts", "kept"), [c[1:] for c in WALK], ids=[c[0] for c in WALK])
def test_walk(rows: list[AttemptRecord], nxt: int | None, starts: list[int], kept: list[int]) -> None:
    assert walk(rows, nxt) == (starts, kept)
