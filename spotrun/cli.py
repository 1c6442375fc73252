"""`spotrun`: the command line, the outermost face of the project (it imports the rest; nothing imports it).

Each top-level command registers itself in `COMMANDS`; a handler returns the exit code. Expected
errors (a bad spec, a missing bucket) become one line on stderr and exit 2, never a traceback.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import select
import sys
from collections.abc import Callable
from dataclasses import asdict
from typing import TYPE_CHECKING

from spotrun.checkpoints_cmd import add_checkpoints
from spotrun.console import (
    EXIT_OK,
    EXIT_STDOUT_CLOSED,
    Handler,
    Subparsers,
    attempts_table,
    error_exit,
    missing_sqlite,
    safe_url,
    wide_console,
)
from spotrun.deploy_cmd import add_deploy, add_serve
from spotrun.init_cmd import add_init
from spotrun.pool_cmd import add_pool
from spotrun.report_cmd import add_report
from spotrun.run_cmd import add_run
from spotrun.server_cmd import add_server
from spotrun.tasks.settings import spotrun_home
from spotrun.trainer.errors import SpotrunError
from spotrun.trainer.storage.locks import private_home

if TYPE_CHECKING:  # imported where used: most commands need not load SQLAlchemy
    from spotrun.tasks.history import HistoryStore

log = logging.getLogger(__name__)


# ---- history: the attempts in SQL ----


def cmd_history(args: argparse.Namespace) -> int:
    """`spotrun history`: the newest attempts (of a job) from the SQL history, as a table or JSON."""
    from sqlalchemy import exc as sa_exc

    from spotrun.tasks.history import HistoryStore, StoreUnavailable
    from spotrun.tasks.settings import Settings

    settings = Settings.from_env()
    url = settings.database_url
    try:
        # A read creates no database; opening one replays the writes its journal holds.
        store = None if missing_sqlite(url) else HistoryStore.open(url, journal_dir=settings.journal_dir)
        rows = (
            store.attempts(job=args.job, limit=args.limit, run_key=args.run_key) if store is not None else []
        )
        keys = run_keys_of(store, {r.job_run_id for r in rows}) if store is not None else {}
    except (StoreUnavailable, ValueError, sa_exc.ArgumentError) as e:
        return error_exit(e)
    if store is not None:
        store.close()
    of = (f" of {args.job}" if args.job else "") + (f" run key {args.run_key}" if args.run_key else "")
    if args.json:
        print(
            json.dumps([asdict(r) | {"run_key": keys.get(r.job_run_id)} for r in rows], indent=2, default=str)
        )
    elif not rows:
        wide_console().print(f"no attempts{of} in {safe_url(url)}", markup=False)
    else:
        if keys:  # grouped by run key, each key's attempts in order
            rows = sorted(rows, key=lambda r: (keys.get(r.job_run_id, ""), r.started_at, r.attempt))
        title = f"attempts{of} (newest {len(rows)}{', by run key' if keys else ', oldest first'})"
        wide_console().print(attempts_table(rows, title, with_run=True, keys=keys))
    return EXIT_OK


def run_keys_of(store: HistoryStore, job_run_ids: set[str]) -> dict[str, str]:
    """job run id -> run key, for the keyed ones among `job_run_ids`."""
    runs = [store.job_run(i) for i in sorted(job_run_ids)]
    return {r.id: r.run_key for r in runs if r is not None and r.run_key}


def _add_history(sub: Subparsers) -> None:
    help_ = "the attempts of past job runs, from the SQL history (SPOTRUN_DATABASE_URL)"
    p = sub.add_parser("history", help=help_, description=help_)
    p.add_argument("job", metavar="JOB", nargs="?", help="only this job's attempts")
    p.add_argument("--json", action="store_true", help="print a JSON list instead of a table")
    p.add_argument("--limit", type=int, default=50, metavar="N", help="the newest N attempts (default 50)")
    p.add_argument("--run-key", metavar="KEY", help="only the attempts of this run key's job runs")
    p.set_defaults(handler=cmd_history)


# ---- the command registry ----

COMMANDS: dict[str, Callable[[Subparsers], None]] = {
    "init": add_init,
    "checkpoints": add_checkpoints,
    "run": add_run,
    "history": _add_history,
    "report": add_report,
    "deploy": add_deploy,
    "serve": add_serve,
    "server": add_server,
    "pool": add_pool,
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="spotrun", description="Fault-tolerant training on spot GPUs.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for register in COMMANDS.values():
        register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `spotrun` console script; returns the exit code."""
    logging.basicConfig(level=logging.WARNING, format="spotrun: %(levelname)s: %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    # One home for this command and every process it starts (flows, trainers, workers): a relative
    # or unset SPOTRUN_HOME is fixed here, before anything changes directory.
    os.environ["SPOTRUN_HOME"] = str(spotrun_home())
    private_home(spotrun_home())  # 0700 home, 0600 files (a store elsewhere keeps its own mode)
    handler: Handler = args.handler
    try:
        code = handler(args)
        sys.stdout.flush()  # a reader gone before the last write shows here, not at exit
        return code
    except BrokenPipeError as e:
        return _stdout_closed() if _stdout_gone() else error_exit(e)  # else a socket's or a child's
    except (SpotrunError, OSError) as e:  # expected failures: one line, no traceback
        return error_exit(e)
    except KeyboardInterrupt:
        return 130


def _stdout_gone() -> bool:
    """Is stdout a pipe whose reader has closed it (poll reports POLLERR on its write end)?"""
    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLOUT)
        return any(events & select.POLLERR for _, events in poller.poll(0))
    except (OSError, ValueError):  # no descriptor (captured): not a closed pipe
        return False


def _stdout_closed() -> int:
    """The reader of stdout went away (`spotrun history | head -1`): end quietly, as Unix tools do."""
    # Python flushes stdout again at exit; pointed at /dev/null, that flush cannot fail anew.
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    return EXIT_STDOUT_CLOSED


if __name__ == "__main__":
    sys.exit(main())
