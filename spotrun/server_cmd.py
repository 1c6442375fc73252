"""`spotrun server start|stop|status`: a local Prefect server kept running in the background.

`spotrun run` (and `serve`, `deploy`, the demo) use it when PREFECT_API_URL is unset, so a run does not
pay a server start (7-14 s on 2 cores) and its flow-run link still opens after the run ends. A team
keeps it on PostgreSQL (`--database`, or SPOTRUN_PREFECT_DATABASE_URL; spotrun/prefect_db.py says why)."""

from __future__ import annotations

import argparse
import shlex
import time

from spotrun.console import EXIT_FINDINGS, EXIT_OK, Subparsers

STATUS_NOT_RUNNING = EXIT_FINDINGS  # `status`: 0 running, 1 not running (scripts test it)


def cmd_start(args: argparse.Namespace) -> int:
    """Start the background server unless it runs; print its UI address and how to point tools at it."""
    from spotrun import prefect_db
    from spotrun.server import (
        AUTH_FILE,
        check_bind,
        configured_database,
        running_server,
        server_home,
        start_background,
    )
    from spotrun.tasks.settings import spotrun_home

    check_bind(args.host, args.public_url)  # before anything is started or written
    database = args.database or configured_database()
    where = prefect_db.shown(prefect_db.server_database_url(database)) if database else "SQLite"
    home = spotrun_home()
    if running_server(home) is None:
        print(f"starting a Prefect server under {server_home(home)} ({where}) ...", flush=True)
    t0 = time.monotonic()
    bg, started = start_background(
        home, args.port, args.timeout, host=args.host, public_url=args.public_url, database=database
    )
    how = f"started in {time.monotonic() - t0:.0f} s" if started else "already running"
    print(f"Prefect server {how}: {bg.ui_url} (pid {bg.pid}, log {bg.log})")
    if bg.database:
        print(f"Its runs are kept in {bg.database}")
    auth = shlex.quote(str(server_home(home) / AUTH_FILE))
    print(f"The UI asks for its auth string: the contents of {auth}")
    print("spotrun run uses it while PREFECT_API_URL is unset; other Prefect tools need:")
    print(f"  export PREFECT_API_URL={bg.api_url}")
    print(f'  export PREFECT_API_AUTH_STRING="$(cat {auth})"')
    return EXIT_OK


def cmd_stop(args: argparse.Namespace) -> int:
    """Stop the background server; its database (flow-run history) stays for the next start."""
    from spotrun.server import stop_background
    from spotrun.tasks.settings import spotrun_home

    stopped = stop_background(spotrun_home(), timeout_s=args.timeout)
    if stopped is None:
        print("no background Prefect server is running")
    else:
        print(f"stopped the Prefect server at {stopped.ui_url} (pid {stopped.pid})")
    return EXIT_OK


def cmd_status(args: argparse.Namespace) -> int:
    """Exit 0 and print the address when the background server runs and answers; else exit 1."""
    from spotrun.server import running_server, server_home
    from spotrun.tasks.settings import spotrun_home

    home = spotrun_home()
    bg = running_server(home)
    if bg is None:
        print(
            f"no background Prefect server is running (home {server_home(home)}); start: spotrun server start"
        )
        return STATUS_NOT_RUNNING
    up = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(bg.started_at))
    print(f"running: {bg.ui_url} (pid {bg.pid}, since {up}, log {bg.log})")
    if bg.database:
        print(f"database: {bg.database}")
    return EXIT_OK


def add_server(sub: Subparsers) -> None:
    help_ = "start, stop or check a local Prefect server kept running in the background"
    epilog = (
        "The server listens on 127.0.0.1 (port 4200 when free), keeps its SQLite database under "
        "$SPOTRUN_HOME/prefect (or its runs on PostgreSQL: --database) and survives the terminal. It "
        "answers only requests that carry the auth string in $SPOTRUN_HOME/prefect/auth_string (0600). "
        "spotrun run, serve and deploy use it while PREFECT_API_URL is unset (spotrun run starts it when"
        " it is not running). status exits 0 when it runs and answers, 1 when not."
    )
    p = sub.add_parser("server", help=help_, description=help_, epilog=epilog)
    actions = p.add_subparsers(dest="action", required=True, metavar="ACTION")
    start = actions.add_parser("start", help="start it (nothing to do when it runs)")
    start.add_argument(
        "--port", type=int, metavar="N", help="port on 127.0.0.1 (default 4200 when free; 0: any free port)"
    )
    start.add_argument(
        "--host",
        default="127.0.0.1",
        metavar="ADDR",
        help="listen here (default 127.0.0.1); off loopback only with --public-url (else exit 2)",
    )
    start.add_argument(
        "--public-url",
        metavar="URL",
        help="the https address of the TLS proxy in front of it (needed for a --host off loopback)",
    )
    start.add_argument(
        "--database",
        metavar="URL",
        help="keep its runs on PostgreSQL: postgresql://USER[:PASSWORD]@HOST[:PORT]/DB (default: "
        "$SPOTRUN_PREFECT_DATABASE_URL, else SQLite under $SPOTRUN_HOME/prefect)",
    )
    start.add_argument("--timeout", type=float, default=90, metavar="S", help="wait this long for it")
    start.set_defaults(handler=cmd_start)
    stop = actions.add_parser("stop", help="stop it (SIGTERM, then SIGKILL); its database stays")
    stop.add_argument("--timeout", type=float, default=15, metavar="S", help="SIGKILL after this long")
    stop.set_defaults(handler=cmd_stop)
    status = actions.add_parser("status", help="exit 0 when it runs and answers, 1 when not")
    status.set_defaults(handler=cmd_status)
