"""`spotrun report` against real history databases built with HistoryStore: the fixed history of
tests/unit/test_goodput.py gives the numbers computed there by hand (SQLite, and PostgreSQL on
127.0.0.1:5432 when one answers); the table, the plot, and the one-line errors on SQLite."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import create_engine, update

from spotrun.cli import main
from spotrun.tasks.decisions.attempts import Outcome
from spotrun.tasks.history import HistoryStore, JobStatus, default_url
from spotrun.tasks.history.engine import normalize_url
from spotrun.tasks.history.models import JobRun
from tests.unit.test_goodput import (
    ENDED,
    EXPECTED,
    EXPECTED_ATTEMPTS,
    EXPECTED_CAUSES,
    HISTORY,
    T,
    attempt,
)


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def build(url: str) -> tuple[str, str]:
    """An older job run of digits (one attempt, completed), the fixed history as digits' newest job run
    (ended at T+440), and a job run of another job: (the newest digits run's id, the older one's)."""
    with HistoryStore.open(url) as store:
        old = store.start_job_run(
            "digits", "sha256:old", None, storage_uri="file:///tmp/digits", provider="local"
        )
        store.record_attempt(
            old,
            attempt(1, Outcome.COMPLETED, -1000, -900, trained=-990, durable=300, last=300, productive=80.0),
        )
        store.finish_job_run(old, JobStatus.COMPLETED, "done")
        new = store.start_job_run(
            "digits", "sha256:abc", None, storage_uri="file:///tmp/digits", provider="local"
        )
        for record in HISTORY:
            store.record_attempt(new, record)
        store.finish_job_run(new, JobStatus.COMPLETED, "trained to step 300 in 5 attempts")
        other = store.start_job_run(
            "charlm", "sha256:def", None, storage_uri="file:///tmp/charlm", provider="local"
        )
        store.record_attempt(other, attempt(1, Outcome.CRASHED, 0, 10, last=3))
    # The store stamps a job run's end with the time it is told; the fixed history ends at T+440.
    engine = create_engine(normalize_url(url))
    with engine.begin() as conn:
        ended = {old: datetime.fromtimestamp(T - 890, UTC), new: datetime.fromtimestamp(ENDED, UTC)}
        for run_id, at in ended.items():
            conn.execute(update(JobRun).where(JobRun.id == run_id).values(ended_at=at))
    engine.dispose()
    return new, old


def use(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, url: str) -> None:
    monkeypatch.setenv("SPOTRUN_DATABASE_URL", url)
    monkeypatch.setenv("SPOTRUN_HOME", str(tmp_path / "home"))


@pytest.fixture
def sqlite_history(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[str, str]:
    url = default_url(tmp_path)
    use(monkeypatch, tmp_path, url)
    return build(url)


def approx(want: Any) -> Any:
    return pytest.approx(want) if isinstance(want, float) else want


def test_json_equals_the_hand_computed_numbers(
    capsys: pytest.CaptureFixture[str], db_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On SQLite and on PostgreSQL: the numbers of tests/unit/test_goodput.py, from SQL alone."""
    use(monkeypatch, tmp_path, db_url)
    new, old = build(db_url)
    code, out, err = run(capsys, "report", "digits", "--json")
    assert (code, err) == (0, "")
    rep = json.loads(out)  # one JSON object
    assert (rep["job"], rep["job_run_id"], rep["status"], rep["plot"]) == ("digits", new, "completed", None)
    for key, want in EXPECTED.items():
        assert rep[key] == approx(want), key
    causes = [(c["cause"], c["attempts"], c["lost_steps"], c["lost_gpu_s"]) for c in rep["lost_by_cause"]]
    assert causes == [(c, n, s, approx(g)) for c, n, s, g in EXPECTED_CAUSES]
    got = [(a["attempt"], a["start_step"], a["kept_step"], a["lost_steps"]) for a in rep["attempts"]]
    assert got == [e[:4] for e in EXPECTED_ATTEMPTS]
    assert rep["unavailable"] == {} and "GPUs per worker: 1 assumed" in rep["notes"][0]

    code, out, _ = run(capsys, "report", "digits", "--run", old[:8], "--json")  # an older job run
    rep = json.loads(out)
    assert (code, rep["job_run_id"], rep["wall_s"]) == (0, old, approx(-890.0 - -1000.0))  # 110 s
    assert rep["effective_s"] == approx(80.0) and rep["goodput"] == approx(80 / 110)
    assert set(rep["unavailable"]) == {"cost_usd", "on_demand_usd", "checkpoint_overhead_s"}


def table_rows(out: str) -> dict[str, str]:
    cells = [[c.strip() for c in line.split("│")[1:-1]] for line in out.splitlines() if line.startswith("│")]
    return {c[0]: c[1] for c in cells if len(c) == 2}


def test_table_and_plot(
    capsys: pytest.CaptureFixture[str], sqlite_history: tuple[str, str], tmp_path: Path
) -> None:
    png = tmp_path / "out" / "goodput.png"
    code, out, err = run(capsys, "report", "digits", "--plot", str(png))
    assert (code, err) == (0, "")
    rows = table_rows(out)
    assert rows["wall time"] == "440.0 s (first attempt start -> job end)"
    assert rows["effective training time"] == "155.0 s"  # 50 + 30 + 75
    assert rows["goodput"] == "35.2%"  # 155 / 440
    assert rows["lost steps"] == "140 (crashed 90, lost 20, preempted 30)"
    assert rows["lost GPU-seconds"] == "79.6 (1 GPU(s) per worker)"  # 15 + 54 + 20 x 185/350
    assert rows["recovery"] == "3 x, mean 40.0 s, max 70.0 s"
    assert rows["checkpoint overhead"] == "8.2 s (5.3% of ETT)"  # 90 x 2 / 22; / 155
    assert rows["cost"] == "$0.50 spot vs $2.00 on demand (75% saved)"
    assert "note: GPUs per worker: 1 assumed" in out and f"plot: {png}" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def test_unknown_job_is_one_line_naming_the_known_ones(
    capsys: pytest.CaptureFixture[str], sqlite_history: tuple[str, str]
) -> None:
    code, out, err = run(capsys, "report", "digts")
    assert (code, out) == (2, "")
    assert err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith("spotrun: error: no job run of 'digts' in sqlite:///")
    assert err.rstrip().endswith("known jobs: charlm, digits")  # newest first


def test_a_run_that_is_not_the_jobs_is_one_line(
    capsys: pytest.CaptureFixture[str], sqlite_history: tuple[str, str]
) -> None:
    new, _ = sqlite_history
    code, _, err = run(capsys, "report", "charlm", "--run", new[:8])
    assert code == 2 and err.count("\n") == 1
    assert f"--run {new[:8]!r} matches no job run of 'charlm'" in err


def test_without_a_database_creates_none(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    use(monkeypatch, tmp_path, default_url(tmp_path / "nothing"))
    code, _, err = run(capsys, "report", "digits", "--json")
    assert code == 2 and err.count("\n") == 1 and "no job run of 'digits'" in err
    assert not (tmp_path / "nothing").exists()


def test_unreachable_database_is_one_line(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    use(monkeypatch, tmp_path, "postgresql://spotrun@127.0.0.1:9/history")  # port 9 (discard): refused
    code, _, err = run(capsys, "report", "digits")
    assert code == 2 and err.count("\n") == 1 and "is unreachable" in err
