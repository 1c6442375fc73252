"""`spotrun report JOB`: goodput of a job run from the SQL history alone
(tasks/reports/goodput.py computes it).

Reads the job's newest job run (or `--run ID`, a prefix) and its attempts; prints a short table, or one
JSON object with `--json`; `--plot PATH` writes step against wall time with the lost work shaded. An
unknown job, or a job run that is not the job's, is one line on stderr naming the known ones, exit 2.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import TYPE_CHECKING

from rich.markup import escape
from rich.table import Table

from spotrun.console import EXIT_OK, Subparsers, error_exit, missing_sqlite, safe_url, wide_console

if TYPE_CHECKING:  # imported where used: the other commands need not load SQLAlchemy
    from spotrun.tasks.history import AttemptRow, HistoryStore, JobRunRow
    from spotrun.tasks.reports.goodput import GoodputReport

KNOWN_JOBS_SHOWN = 20  # names in the unknown-job line; more are counted
RUNS_SCANNED = 10_000  # job runs read to list the known job names (newest first)


class UnknownJob(ValueError):
    """The job (or job run) is not in the history: the one line names what is."""


def cmd_report(args: argparse.Namespace) -> int:
    from sqlalchemy import exc as sa_exc

    from spotrun.tasks.history import HistoryStore, StoreUnavailable
    from spotrun.tasks.reports.goodput import RunInfo, compute
    from spotrun.tasks.settings import Settings

    settings = Settings.from_env()
    url = settings.database_url
    try:
        if missing_sqlite(url):  # a read creates no database
            raise UnknownJob(f"no job run of {args.job!r} in {safe_url(url)}: it holds no history yet")
        store = HistoryStore.open(url, journal_dir=settings.journal_dir)
        try:
            run = _job_run(store, args.job, args.run, where=safe_url(url), run_key=args.run_key)
            rows = store.attempts(job_run_id=run.id, limit=1_000_000)
        finally:
            store.close()
    except (UnknownJob, StoreUnavailable, ValueError, sa_exc.ArgumentError) as e:
        return error_exit(e)
    # The spec is not in SQL (only its hash): GPUs per worker stays unknown (1, said in the notes).
    info = RunInfo(run.job, run.id, run.status.value, run.ended_at)
    report = compute(rows, info, now=time.time())
    try:
        plot = _plot(rows, report, Path(args.plot)) if args.plot else None
    except OSError as e:  # only the --plot path is written here: the user's to fix
        why = e.strerror or str(e)
        return error_exit(ValueError(f"--plot {args.plot}: cannot write there ({why}); give a writable path"))
    keyed = {
        "run_key": run.run_key,
        "run_values": run.run_values,
        "lineage": run.lineage,
        "promotion": run.promotion,
    }
    if args.json:
        print(json.dumps({**report.as_dict(), **keyed, "plot": str(plot) if plot else None}, indent=2))
    else:
        _print(report, plot, keyed_lines(run))
    return EXIT_OK


def keyed_lines(run: JobRunRow) -> list[str]:
    """A keyed job run's key, warm start and promotion decision, one line each (none for other runs)."""
    lines = [f"run key: {run.run_key}"] if run.run_key else []
    lineage = run.lineage or {}
    if src := lineage.get("init_from"):
        lines.append(f"warm start: {src['job']} run key {src.get('run_key') or '-'} step {src['step']}")
    elif lineage.get("init_note"):
        lines.append(f"warm start: {lineage['init_note']}")
    if p := run.promotion:
        lines.append(f"promotion: {p.get('reason') or p}")
    return lines


def _job_run(
    store: HistoryStore, job: str, run_id: str | None, *, where: str, run_key: str | None = None
) -> JobRunRow:
    """The job run to report: each answer one indexed read of a few rows, however long the history (a
    scan of RUNS_SCANNED job runs only to say what exists when nothing matched)."""
    runs = store.job_runs(job, limit=1, run_key=run_key)
    if not runs:
        raise _unknown(store, job, where=where, run_key=run_key)
    if run_id is None:
        return runs[-1]
    hits = store.job_runs(job, limit=2, run_key=run_key, id_prefix=run_id)
    if len(hits) != 1:
        newest = ", ".join(r.id[:8] for r in reversed(store.job_runs(job, limit=5, run_key=run_key)))
        how = "matches no" if not hits else f"matches {len(hits)}"
        raise UnknownJob(
            f"--run {run_id!r} {how} job run of {job!r}; its newest: {newest} (give more of the id)"
        )
    return hits[0]


def _unknown(store: HistoryStore, job: str, *, where: str, run_key: str | None) -> UnknownJob:
    """Why nothing matched: the run key the job does not have, or the job the history does not know."""
    runs = store.job_runs(job, limit=RUNS_SCANNED) if run_key is not None else []
    if runs:
        keys = list(dict.fromkeys(r.run_key for r in reversed(runs) if r.run_key))[:KNOWN_JOBS_SHOWN]
        return UnknownJob(
            f"--run-key {run_key!r}: no job run of {job!r} has it; its newest keys: "
            f"{', '.join(keys) or 'none (the job is not keyed)'}"
        )
    names = list(dict.fromkeys(r.job for r in reversed(store.job_runs(limit=RUNS_SCANNED))))  # newest first
    known = ", ".join(names[:KNOWN_JOBS_SHOWN]) or "none"
    if len(names) > KNOWN_JOBS_SHOWN:
        known += f" and {len(names) - KNOWN_JOBS_SHOWN} more"
    return UnknownJob(f"no job run of {job!r} in {where}; known jobs: {known}")


def _plot(rows: list[AttemptRow], report: GoodputReport, out: Path) -> Path:
    from spotrun.tasks.reports.goodput import progress
    from spotrun.tasks.reports.timeline import AttemptTrace, plot_timeline

    # The step kept is where the shaded lost work begins (the timeline shades above `durable_step`).
    traces = [
        AttemptTrace(
            p.attempt,
            p.outcome,
            p.started_at,
            ended_at=p.ended_at,
            steps=p.points,
            durable_step=p.kept_step,
            resumed_from=p.start_step,
        )
        for p in progress(rows, report)
    ]
    title = f"{report.job} (job run {report.job_run_id[:8]}): step over wall time"
    if report.goodput is not None:
        title += f", goodput {report.goodput:.1%}"
    return plot_timeline(traces, title, out)


def _print(report: GoodputReport, plot: Path | None, keyed: list[str]) -> None:
    from spotrun.tasks.reports.goodput import summary_rows

    console = wide_console()
    for line in keyed:
        console.print(line, markup=False)
    title = f"{report.job}: job run {report.job_run_id[:8]} ({report.status})"
    table = Table(title=escape(title), title_justify="left", show_header=False)
    table.add_column("figure")
    table.add_column("value", overflow="fold")
    for name, value in summary_rows(report):
        table.add_row(name, escape(value))
    console.print(table)
    if report.attempts:
        console.print(_attempts_table(report))
    for key, why in report.unavailable.items():
        console.print(f"unavailable: {key}: {why}", markup=False)
    for note in report.notes:
        console.print(f"note: {note}", markup=False)
    if plot is not None:
        console.print(f"plot: {plot}", markup=False)


def _attempts_table(report: GoodputReport) -> Table:
    table = Table(title="per attempt", title_justify="left")
    names = ["attempt", "outcome", "steps", "kept", "lost", "s/step", "ETT s", "lost GPU-s", "recovery s"]
    for name in names:
        table.add_column(name, justify="left" if name in ("outcome", "steps") else "right")

    def num(x: float | None, digits: int = 1) -> str:
        return "-" if x is None else f"{x:.{digits}f}"

    for f in report.attempts:
        recovery = num(f.recovery_s) + ("*" if f.recovery_to == "attempt start" else "")
        trained = f.outcome != "provision_failed"  # no worker: no steps to show
        steps, kept = (f"{f.start_step}->{f.last_step}", str(f.kept_step)) if trained else ("-", "-")
        table.add_row(
            str(f.attempt),
            f.outcome,
            steps,
            kept,
            str(f.lost_steps),
            num(f.s_per_step, 3),
            num(f.effective_s),
            num(f.lost_gpu_s),
            recovery,
        )
    return table


def add_report(sub: Subparsers) -> None:
    help_ = "goodput of a job run from the SQL history: ETT, lost work per cause, recovery, cost"
    p = sub.add_parser("report", help=help_, description=help_)
    p.add_argument("job", metavar="JOB", help="the job's name (its newest job run, unless --run)")
    p.add_argument("--run", metavar="ID", help="this job run of the job (an id or its first characters)")
    p.add_argument("--run-key", metavar="KEY", help="the newest job run of this run key (a keyed job)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    p.add_argument("--plot", metavar="PATH", help="write step against wall time, losses shaded, as a PNG")
    p.set_defaults(handler=cmd_report)
