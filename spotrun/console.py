"""Console output shared by the commands: exit codes, wide tables, one-line errors."""

from __future__ import annotations

import argparse
import shlex
import shutil
import sys
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

if TYPE_CHECKING:  # imported where used: `spotrun checkpoints` must not load SQLAlchemy or Prefect
    from spotrun.tasks.history import AttemptRow


EXIT_OK, EXIT_FINDINGS, EXIT_ERROR = 0, 1, 2
EXIT_FAILED = 1  # `spotrun run`: the flow run ended Failed
EXIT_INTERRUPTED = 130  # `spotrun run`: Ctrl-C (128 + SIGINT, as shells report it)
EXIT_STDOUT_CLOSED = 141  # 128 + SIGPIPE: what a shell reports for a tool a closed pipe ended

Handler = Callable[[argparse.Namespace], int]
Subparsers = Any  # argparse's _SubParsersAction is private


class _Console(Console):
    def on_broken_pipe(self) -> None:
        """rich's own exits 1 (the code of a failed run); the CLI's main ends quietly with 141."""
        raise BrokenPipeError


def wide_console() -> Console:
    """A rich console that does not fold piped output (logs, CI, tests) to 80 columns."""
    return _Console(highlight=False, width=None if sys.stdout.isatty() else 160)


def size_text(n: int) -> str:
    """Bytes in binary units, for tables."""
    if n < 1024:
        return f"{n} B"
    size, units = n / 1024, ["KiB", "MiB", "GiB", "TiB"]
    while size >= 1024 and len(units) > 1:
        size, units = size / 1024, units[1:]
    return f"{size:.1f} {units[0]}"


def attempts_table(
    rows: Sequence[AttemptRow], title: str, with_run: bool = False, keys: Mapping[str, str] | None = None
) -> Table:
    """Attempts as a rich table; `with_run` adds the job and (short) job-run id columns, `keys` (job run
    id -> run key) the run key's."""
    table = Table(title=escape(title), title_justify="left")
    names = ["job", "run"] if with_run else []
    names += ["run key"] if keys else []
    names += ["attempt", "outcome", "cause", "resumed from", "last step", "lost steps", "wall s", "ended at"]
    numeric = {"attempt", "resumed from", "last step", "lost steps", "wall s"}
    for name in names:
        table.add_column(name, justify="right" if name in numeric else "left", overflow="fold")
    colors = {"completed": "green", "preempted": "yellow", "cancelled": "blue"}
    for r in rows:
        outcome = f"[{colors.get(r.outcome.value, 'red')}]{r.outcome.value}[/]"
        cells = [escape(r.job), r.job_run_id[:8]] if with_run else []
        cells += [escape(keys.get(r.job_run_id, "-"))] if keys else []
        cells += [
            str(r.attempt),
            outcome,
            escape(r.cause),
            "scratch" if r.resumed_from is None else str(r.resumed_from),
            str(r.last_step),
            str(r.lost_steps),
            f"{r.wall_s:.1f}",
            datetime.fromtimestamp(r.ended_at).strftime("%Y-%m-%d %H:%M:%S"),
        ]
        table.add_row(*cells)
    return table


def error_exit(e: BaseException) -> int:
    """Print an expected error as one line on stderr; return the error exit code."""
    print(f"spotrun: error: {one_line(e)}", file=sys.stderr)
    return EXIT_ERROR


def one_line(e: BaseException) -> str:
    return " ".join(str(e).split()) or type(e).__name__


def missing_sqlite(url: str) -> bool:
    """A sqlite URL whose file does not exist: a read must not create the database."""
    from spotrun.tasks.history.engine import normalize_url

    u = normalize_url(url)
    db = u.database
    return u.get_backend_name() == "sqlite" and db not in (None, "", ":memory:") and not Path(db).exists()


def safe_url(url: str) -> str:
    """The database URL as it may be printed (password hidden)."""
    from spotrun.tasks.history.engine import normalize_url, shown_url

    return shown_url(normalize_url(url))


def spotrun_command(cwd: Path | None = None) -> str:
    """`spotrun` as a shell in `cwd` runs it: the bare name when PATH finds this environment's script,
    else the script's path (relative under `cwd`: `.venv/bin/spotrun` after `make demo`)."""
    script = Path(sys.executable).parent.resolve() / "spotrun"
    if not script.is_file():  # not installed as a script here: the module runs it all the same
        return f"{shlex.quote(sys.executable)} -m spotrun.cli"
    found = shutil.which("spotrun")
    if found is not None and Path(found).resolve() == script.resolve():
        return "spotrun"
    try:
        rel = script.relative_to((Path.cwd() if cwd is None else cwd).resolve())
    except ValueError:
        return shlex.quote(str(script))
    return shlex.quote(str(rel) if len(rel.parts) > 1 else f"./{rel}")  # a bare name would search PATH
