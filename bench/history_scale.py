"""History at team scale: `spotrun history` and `spotrun report` over a million attempt rows.

A history of JOBS jobs x RUNS job runs x ATTEMPTS attempts (default 100 x 1,000 x 10 = 1,000,000 attempt
rows, 100,000 job runs, every other run keyed) is generated inside the database (a recursive CTE on
SQLite, generate_series on PostgreSQL: seconds, not a million INSERTs from Python) at schema revision 0005.
Each command is then timed in this process (the CLI's handler, output discarded; median of REPEATS warm
runs) before and after revision 0006's indexes (tasks/history/migrations/versions/0006_listing_indexes.py):

    history            the newest 50 attempts of every job
    history_job        the newest 50 of one job
    history_run_key    the attempts of one run key
    report             a job's newest job run and its attempts (goodput)
    report_run         a job run of a job by the first 8 characters of its id
    report_old_read    what `spotrun report` read before this change: the job's newest 10,000 job runs,
                       then the chosen run's attempts (the report now reads 1, 2 or 5 job runs)

Goal: every command within 1 s after. The process's start (imports) is not in these figures; one
`spotrun history` as a subprocess is timed beside them (`cli_wall_s`, best of 3), and `spotrun --help`
(`cli_help_wall_s`): the start alone.

SQLite: a file under --dir. PostgreSQL: the schema `spotrun_history_scale` of database `test` on
127.0.0.1:5432 (trust auth), dropped at the end. Prints lines per backend; the last line is one JSON
object. Run from the repo root:
    .venv/bin/python bench/history_scale.py [--backends sqlite,postgresql] [--rows 1000000]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from alembic import command
from sqlalchemy import Engine, create_engine, text

from spotrun.cli import cmd_history
from spotrun.report_cmd import RUNS_SCANNED, cmd_report
from spotrun.tasks.history import HistoryStore, store
from spotrun.tasks.history.engine import normalize_url
from spotrun.tasks.history.migrations import alembic_config

REPO = Path(__file__).resolve().parents[1]
JOBS, ATTEMPTS = 100, 10
REPEATS = 3
PG_SCHEMA = "spotrun_history_scale"
PG_URL = f"postgresql://postgres@127.0.0.1:5432/test?options=-csearch_path%3D{PG_SCHEMA}"
T0 = 1_767_225_600  # 2026-01-01, the first job run's start
GOAL_S = 1.0

SQLITE_RUNS = """
WITH RECURSIVE n(i) AS (SELECT 0 UNION ALL SELECT i + 1 FROM n WHERE i < :runs - 1)
INSERT INTO job_runs (id, job, spec_hash, flow_run_id, storage_uri, provider, status, message,
                      started_at, ended_at, controller_restarts, run_key)
SELECT printf('%08x-0000-4000-8000-%012x', i, i), 'job-' || (i % :jobs), 'spec', NULL, 's3://bucket/job',
       'local', 'completed', '', datetime(:t0 + i * 60, 'unixepoch') || '.000000',
       datetime(:t0 + i * 60 + 55, 'unixepoch') || '.000000', 0,
       CASE WHEN i % 2 = 0 THEN 'key-' || i END
FROM n
"""
SQLITE_ATTEMPTS = """
WITH RECURSIVE n(i) AS (SELECT 0 UNION ALL SELECT i + 1 FROM n WHERE i < :rows - 1)
INSERT INTO attempts (job_run_id, job, attempt, worker_id, provider, started_at, ended_at, outcome, cause,
                      exit_code, signal, trainer_code, error, log_tail, resumed_from, resumed_checkpoint,
                      last_step, last_durable_step, lost_steps, notice_lead_s, wall_s, productive_s, extra)
SELECT printf('%08x-0000-4000-8000-%012x', i / :att, i / :att), 'job-' || ((i / :att) % :jobs),
       i % :att + 1, 'w-' || i, 'local',
       datetime(:t0 + (i / :att) * 60 + (i % :att) * 5, 'unixepoch') || '.000000',
       datetime(:t0 + (i / :att) * 60 + (i % :att) * 5 + 4, 'unixepoch') || '.000000',
       CASE WHEN i % :att = :att - 1 THEN 'completed' ELSE 'preempted' END, 'spot reclaim', NULL, NULL,
       NULL, '', '', (i % :att) * 100, NULL, (i % :att) * 100 + 120, (i % :att) * 100 + 100, 20, NULL, 4.0,
       3.5, '{}'
FROM n
"""
PG_RUNS = """
INSERT INTO job_runs (id, job, spec_hash, flow_run_id, storage_uri, provider, status, message,
                      started_at, ended_at, controller_restarts, run_key)
SELECT lpad(to_hex(i), 8, '0') || '-0000-4000-8000-' || lpad(to_hex(i), 12, '0'), 'job-' || (i % :jobs),
       'spec', NULL, 's3://bucket/job', 'local', 'completed', '', to_timestamp(:t0 + i * 60),
       to_timestamp(:t0 + i * 60 + 55), 0, CASE WHEN i % 2 = 0 THEN 'key-' || i END
FROM generate_series(0, :runs - 1) AS i
"""
PG_ATTEMPTS = """
INSERT INTO attempts (job_run_id, job, attempt, worker_id, provider, started_at, ended_at, outcome, cause,
                      exit_code, signal, trainer_code, error, log_tail, resumed_from, resumed_checkpoint,
                      last_step, last_durable_step, lost_steps, notice_lead_s, wall_s, productive_s, extra)
SELECT lpad(to_hex(i / :att), 8, '0') || '-0000-4000-8000-' || lpad(to_hex(i / :att), 12, '0'),
       'job-' || ((i / :att) % :jobs), i % :att + 1, 'w-' || i, 'local',
       to_timestamp(:t0 + (i / :att) * 60 + (i % :att) * 5),
       to_timestamp(:t0 + (i / :att) * 60 + (i % :att) * 5 + 4),
       CASE WHEN i % :att = :att - 1 THEN 'completed' ELSE 'preempted' END, 'spot reclaim', NULL, NULL,
       NULL, '', '', (i % :att) * 100, NULL, (i % :att) * 100 + 120, (i % :att) * 100 + 100, 20, NULL, 4.0,
       3.5, '{}'::json
FROM generate_series(0, :rows - 1) AS i
"""


def migrate(engine: Engine, revision: str) -> float:
    """Bring the schema to `revision`; the seconds it took (index builds over the rows there)."""
    t = time.perf_counter()
    with engine.connect() as conn:
        if conn.dialect.name == "postgresql":
            conn.exec_driver_sql("SET statement_timeout = 0")
        command.upgrade(alembic_config(conn), revision)
        conn.commit()
    return time.perf_counter() - t


def generate(engine: Engine, rows: int) -> float:
    """The history's rows, made by the database itself; the seconds it took."""
    runs = rows // ATTEMPTS
    params = {"runs": runs, "rows": runs * ATTEMPTS, "jobs": JOBS, "att": ATTEMPTS, "t0": T0}
    pg = engine.dialect.name == "postgresql"
    t = time.perf_counter()
    with engine.begin() as conn:
        if pg:
            conn.exec_driver_sql("SET LOCAL statement_timeout = 0")
        conn.execute(text(PG_RUNS if pg else SQLITE_RUNS), params)
        conn.execute(text(PG_ATTEMPTS if pg else SQLITE_ATTEMPTS), params)
    with engine.connect() as conn:  # fresh statistics, as autovacuum / a later ANALYZE would give
        conn.exec_driver_sql("ANALYZE")
        conn.commit()
    return time.perf_counter() - t


def timed(fn: Callable[[], object]) -> float:
    """The median of REPEATS warm runs, seconds (a first run warms the caches and is dropped)."""
    fn()
    times = []
    for _ in range(REPEATS):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def quiet(handler: Callable[[argparse.Namespace], int], **args: Any) -> Callable[[], None]:
    """A CLI handler called as the command line would, its output discarded; a failure raises."""

    def run() -> None:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()) as err:
            code = handler(argparse.Namespace(**args))
        if code != 0:
            raise RuntimeError(f"{handler.__name__}{args}: exit {code}: {err.getvalue().strip()}")

    return run


def old_report_read(url: str, job: str) -> Callable[[], None]:
    """What `spotrun report JOB` read before: RUNS_SCANNED job runs, then the newest one's attempts."""

    def run() -> None:
        with HistoryStore.open(url) as store:
            runs = store.job_runs(job, limit=RUNS_SCANNED)
            store.attempts(job_run_id=runs[-1].id, limit=1_000_000)

    return run


def commands(url: str, runs: int) -> dict[str, Callable[[], None]]:
    newest = runs - 1
    job = f"job-{newest % JOBS}"
    key_run = newest - newest % 2  # an even run: keyed
    prefix = f"{newest - JOBS:08x}"  # an older run of the same job
    hist = {"json": True, "limit": 50}
    report = {"json": True, "plot": None}
    return {
        "history": quiet(cmd_history, job=None, run_key=None, **hist),
        "history_job": quiet(cmd_history, job=job, run_key=None, **hist),
        "history_run_key": quiet(cmd_history, job=None, run_key=f"key-{key_run}", **hist),
        "report": quiet(cmd_report, job=job, run=None, run_key=None, **report),
        "report_run": quiet(cmd_report, job=job, run=prefix, run_key=None, **report),
        "report_old_read": old_report_read(url, job),
    }


def measure(url: str, runs: int) -> dict[str, float]:
    """Each command's time, with the schema held where it is: a store brings it to head on first use,
    and the "before" figures would otherwise be taken after the indexes (the version check that costs
    each open is left out of both; `cli_wall_s` has it)."""
    os.environ["SPOTRUN_DATABASE_URL"] = url
    real = store.upgrade_to_head
    store.upgrade_to_head = lambda bind: None  # type: ignore[assignment]
    out = {}
    try:
        for name, fn in commands(url, runs).items():
            out[name] = round(timed(fn), 4)
            print(f"  {name:<16} {out[name]:8.3f} s", flush=True)
    finally:
        store.upgrade_to_head = real
    return out


def cli_wall(url: str, *args: str) -> float:
    """One `spotrun ARGS` as its own process (the best of 3): imports, connection and query."""
    env = {**os.environ, "SPOTRUN_DATABASE_URL": url, "PYTHONPATH": str(REPO)}
    best = float("inf")
    for _ in range(REPEATS):
        t = time.perf_counter()
        subprocess.run(
            [sys.executable, "-m", "spotrun.cli", *args], env=env, check=True, stdout=subprocess.DEVNULL
        )
        best = min(best, time.perf_counter() - t)
    return round(best, 3)


def run_backend(backend: str, rows: int, work: Path) -> dict[str, Any]:
    if backend == "sqlite":
        url = f"sqlite:///{work / 'history.db'}"
        drop: Callable[[], None] = lambda: None  # noqa: E731 (the directory goes with the run)
    else:
        admin = create_engine(normalize_url(PG_URL.split("?")[0]))
        with admin.begin() as conn:
            conn.exec_driver_sql(f"DROP SCHEMA IF EXISTS {PG_SCHEMA} CASCADE")
            conn.exec_driver_sql(f"CREATE SCHEMA {PG_SCHEMA}")

        def drop() -> None:
            with admin.begin() as conn:
                conn.exec_driver_sql(f"DROP SCHEMA IF EXISTS {PG_SCHEMA} CASCADE")
            admin.dispose()

        url = PG_URL
    engine = create_engine(normalize_url(url))
    try:
        migrate(engine, "0005")
        print(f"{backend}: generating {rows:,} attempt rows ...", flush=True)
        gen_s = generate(engine, rows)
        print(f"{backend}: generated in {gen_s:.1f} s; before (revision 0005):", flush=True)
        before = measure(url, rows // ATTEMPTS)
        index_s = migrate(engine, "head")
        print(f"{backend}: revision 0006 in {index_s:.1f} s; after:", flush=True)
        after = measure(url, rows // ATTEMPTS)
        wall = cli_wall(url, "history", "--json")
        startup = cli_wall(url, "--help")
        print(f"{backend}: `spotrun history` as a process: {wall:.2f} s (`spotrun --help`: {startup:.2f} s)")
    finally:
        engine.dispose()
        drop()
    worst = max(v for k, v in after.items() if k != "report_old_read")
    return {
        "rows": rows,
        "generate_s": round(gen_s, 1),
        "migrate_0006_s": round(index_s, 2),
        "before_s": before,
        "after_s": after,
        "worst_after_s": worst,
        "cli_wall_s": wall,
        "cli_help_wall_s": startup,
        "goal_met": worst <= GOAL_S,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--backends", default="sqlite,postgresql", help="comma-separated: sqlite, postgresql")
    ap.add_argument("--rows", type=int, default=1_000_000, help="attempt rows (default 1,000,000)")
    ap.add_argument("--dir", type=Path, default=None, help="where the SQLite file goes (default: a temp dir)")
    args = ap.parse_args()
    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    if not backends or set(backends) - {"sqlite", "postgresql"} or args.rows < JOBS * ATTEMPTS:
        ap.error(f"--backends takes sqlite and/or postgresql; --rows at least {JOBS * ATTEMPTS}")
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="spotrun-history-", dir=args.dir) as d:
        for backend in backends:
            results[backend] = run_backend(backend, args.rows, Path(d))
    summary = {"bench": "history_scale", "goal_s": GOAL_S, **results}
    print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
