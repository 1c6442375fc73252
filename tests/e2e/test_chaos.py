"""The chaos campaign's 50-fault variant (bench/chaos.py, with a controller episode), and its invariant
checks driven by tables."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from bench import chaos  # noqa: E402
from bench.chaos_checks import bad_adoptions, history_gaps, interleaved_writers  # noqa: E402


@pytest.mark.parametrize(
    ("pids", "bad"),
    [
        ([], 0),
        ([1, 1, 1], 0),
        ([1, 1, 2, 2, 3], 0),  # one after another: a takeover after each death
        ([1, 2, 1], 1),  # 1 wrote again after 2 took over
        ([1, 2, 1, 2], 2),
        ([1, 2, 3, 1, 3], 2),
    ],
)
def test_interleaved_writers(pids: list[int], bad: int) -> None:
    assert interleaved_writers(pids) == bad


@pytest.mark.parametrize(
    ("written", "present", "gaps"),
    [
        ([1, 2, 3], [1, 2, 3], 0),
        ([1, 2, 3], [1, 3], 1),  # a journaled row never replayed
        ([1, 2], [1, 2, 2], 1),  # replayed twice
        ([], [1], 0),  # a row the campaign did not see written (killed mid-write) may land
        ([1], [], 1),
    ],
)
def test_history_gaps(written: list[int], present: list[int], gaps: int) -> None:
    assert history_gaps(written, present) == gaps


@pytest.mark.parametrize(
    ("kills", "runs", "lost", "bad"),
    [
        ([], [("completed", 0)], [], 0),  # never killed, or killed before it held the job run
        (["w1", ""], [("completed", 2)], ["w1"], 0),  # the 2nd kill came between attempts: no row
        (["w1", "w1"], [("completed", 2)], ["w1"], 0),  # the 2nd controller died before its own worker
        (["w1", ""], [("completed", 2)], ["w1", ""], 1),  # a lost row for nothing in flight
        (["w1"], [("completed", 1), ("completed", 0)], ["w1"], 2),  # not adopted: a 2nd job run, no restart
        (["w1"], [("running", 1)], ["w1"], 1),  # never closed
        (["w1", "w2"], [("completed", 1)], ["w1", "w2"], 1),  # a restart not counted
        (["w1", "w2"], [("completed", 2)], ["w1"], 1),  # a kill left no lost row
        (["w1"], [("completed", 1)], ["w9"], 1),  # the lost row names another worker
        (["w1"], [], [], 2),  # no job run at all, no lost row
    ],
)
def test_bad_adoptions(kills: list[str], runs: list[tuple[str, int]], lost: list[str], bad: int) -> None:
    assert bad_adoptions(kills, runs, lost) == bad


def test_an_episode_draws_the_same_whatever_ran_before() -> None:
    """`--episode N` replays episode N alone: its draws depend on (seed, N) only."""
    draws = [chaos.episode_rng(23, 42).random() for _ in range(2)]
    assert draws[0] == draws[1]
    assert chaos.episode_rng(23, 43).random() != draws[0] != chaos.episode_rng(24, 42).random()
    assert chaos.episode_rng(23, 42, "s3", 1).random() != draws[0]  # the S3 faults' own stream


@pytest.mark.slow
def test_fifty_faults_break_no_invariant(tmp_path: Path) -> None:
    tally = chaos.run(faults=50, seed=11, minutes=4, root=tmp_path)
    assert sum(tally.faults.values()) >= 50
    assert tally.problems == []
    summary = tally.summary()
    invariants = ("bad_resumes", "unreadable_latest", "lost_history_rows", "leaked_processes")
    for key in (*invariants, "duplicate_writers", "bad_adoptions"):
        assert summary[key] == 0, key
    assert tally.attempts >= 3
    assert any(kind.startswith("controller@") for kind in tally.faults), tally.faults  # episode 2
