"""`spotrun deploy` (deployments and alert automations onto a Prefect server) and `spotrun serve` (the
same, plus a worker on this machine that runs what the UI, the scheduler and the automations start)."""

from __future__ import annotations

import argparse
import json
import re
import signal
import threading
from contextlib import nullcontext
from dataclasses import asdict
from types import FrameType
from typing import TYPE_CHECKING

from pydantic import ValidationError
from rich.markup import escape
from rich.table import Table

from spotrun.console import EXIT_OK, Subparsers, wide_console
from spotrun.trainer.errors import ConfigError

if TYPE_CHECKING:  # imported where used: `spotrun --help` must stay fast
    from spotrun.deployments.apply import DeployReport
    from spotrun.deployments.automations import AlertRules, RecoveryRules

_UNITS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}
RULE_FLAGS = {  # AlertRules field -> the flag that sets it, so an error names what the user typed
    "restart_threshold": "--restart-threshold",
    "restart_window_s": "--restart-window",
    "retries": "--alert-retries",
    "retry_delay_s": "--alert-retry-delay",
    "controller_restarts": "--controller-restarts",
    "zombie_after_s": "--zombie-after",
    "missed_run_after_s": "--missed-run-after",
}


def duration_s(text: str) -> float:
    """'3600', '90s', '30m', '1h', '1.5h', '2d' -> seconds; ConfigError otherwise."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smhd]?)\s*", text.lower())
    if m is None:
        raise ConfigError(f"bad duration {text!r}: use seconds or a number with s, m, h or d (e.g. 1h)")
    return float(m[1]) * _UNITS[m[2]]


def alert_rules(args: argparse.Namespace) -> AlertRules:
    """The alert rules from the flags, validated; ConfigError naming the flag otherwise."""
    from spotrun.deployments.automations import AlertRules

    try:
        return AlertRules(
            restart_threshold=args.restart_threshold,
            restart_window_s=duration_s(args.restart_window),
            recovery_note=not args.no_recovery_note,
            retries=args.alert_retries,
            retry_delay_s=duration_s(args.alert_retry_delay),
            missed_run_after_s=duration_s(args.missed_run_after) if args.missed_run_after else None,
        )
    except ValidationError as e:
        err = e.errors()[0]
        raise ConfigError(f"{RULE_FLAGS.get(str(err['loc'][0]), err['loc'][0])}: {err['msg']}") from None


def recovery_rules(args: argparse.Namespace) -> RecoveryRules:
    """How dead controllers are found and restarted, from the flags; ConfigError naming the flag."""
    from spotrun.deployments.automations import RecoveryRules

    try:
        return RecoveryRules(
            controller_restarts=args.controller_restarts,
            restart_window_s=duration_s(args.restart_window),
            zombie_after_s=duration_s(args.zombie_after),
        )
    except ValidationError as e:
        err = e.errors()[0]
        raise ConfigError(f"{RULE_FLAGS.get(str(err['loc'][0]), err['loc'][0])}: {err['msg']}") from None


def print_report(report: DeployReport, ui_url: str, as_json: bool) -> None:
    if as_json:
        doc = {
            "deployments": report.deployments,
            "pools_created": report.pools_created,
            "automations": [asdict(a) for a in report.automations],
            "recovery": report.recovery.model_dump(),
            "allowed": str(report.allowed) if report.allowed else None,
        }
        print(json.dumps(doc, default=str, indent=2))
        return
    out = wide_console()
    for pool in report.pools_created:
        out.print(f"created work pool {escape(pool)} (process)")
    table = Table(title="deployments", title_justify="left")
    for col in ("name", "id", "in the UI"):
        table.add_column(col, overflow="fold")
    for name, dep_id in report.deployments.items():
        table.add_row(escape(name), str(dep_id), f"{ui_url}/deployments/deployment/{dep_id}")
    out.print(table)
    autos = Table(title="automations", title_justify="left")
    for col in ("name", "change", "id"):
        autos.add_column(col)
    for a in report.automations:
        autos.add_row(escape(a.name), a.change, str(a.id))
    out.print(autos)
    r = report.recovery
    out.print(
        f"a training run silent for {r.zombie_after_s:g} s is marked Crashed and rerun, at most "
        f"{r.controller_restarts} times per job within {r.restart_window_s:g} s"
    )
    if report.allowed is not None:
        out.print(
            f"deployment runs on this host may name what {report.allowed} allows "
            "(built-in recipes, the deployments' defaults and your own additions)",
            markup=False,
            soft_wrap=True,
        )


def cmd_deploy(args: argparse.Namespace) -> int:
    """`spotrun deploy`: apply prefect.yaml's deployments and the alert automations, idempotently."""
    from prefect.settings import PREFECT_API_URL

    from spotrun.deployments.apply import deploy
    from spotrun.server import PrefectApi, prefect_api
    from spotrun.tasks.settings import spotrun_home

    rules, recovery = alert_rules(args), recovery_rules(args)
    # PREFECT_API_URL (from the environment or a Prefect profile), else the background server; never
    # a temporary server: deployments on a server stopped when this command ends would serve nobody.
    with prefect_api(spotrun_home(), temporary=False) if not PREFECT_API_URL.value() else nullcontext():
        report = deploy(rules, recovery=recovery, home=spotrun_home())  # neither: DeployError, one line
        print_report(report, PrefectApi(str(PREFECT_API_URL.value()), None).ui_url, args.json)
    return EXIT_OK


def cmd_serve(args: argparse.Namespace) -> int:
    """`spotrun serve`: deploy, then run a worker for the pool until interrupted."""
    from spotrun.deployments.apply import deploy
    from spotrun.deployments.worker import LocalWorker, supervise
    from spotrun.server import prefect_api
    from spotrun.tasks.settings import Settings

    rules, recovery = alert_rules(args), recovery_rules(args)
    settings = Settings.from_env()
    out = wide_console()
    stop = threading.Event()

    def on_term(signum: int, frame: FrameType | None) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, on_term)
    with prefect_api(settings.home, keep=False) as api:
        if api.server is not None:
            out.print(f"started a Prefect server: {api.ui_url}", markup=False)
        print_report(deploy(rules, recovery=recovery, home=settings.home), api.ui_url, args.json)
        worker = LocalWorker(settings.home / "worker.log", query_s=args.poll).start()
        try:
            pid = worker.proc.pid if worker.proc else "?"
            # soft_wrap: one line however long the log path (people and tests grep for it)
            out.print(
                f"worker {worker.name} (pid {pid}) runs the pool's flow runs (log: {worker.log}); "
                "Ctrl-C stops it",
                markup=False,
                soft_wrap=True,
            )
            supervise(worker, stop, lambda line: out.print(line, markup=False, soft_wrap=True))
        except KeyboardInterrupt:
            pass
        finally:
            out.print("stopping the worker ...")
            worker.stop()
    return EXIT_OK


def _alert_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--restart-threshold",
        type=int,
        default=3,
        metavar="N",
        help="restarts of one job that raise a restart-storm alert (default 3)",
    )
    p.add_argument(
        "--restart-window",
        default="1h",
        metavar="DURATION",
        help="... within this window, e.g. 30m, 1h, 2d (default 1h)",
    )
    p.add_argument(
        "--no-recovery-note", action="store_true", help="do not post a note when a job that alerted completes"
    )
    p.add_argument(
        "--alert-retries",
        type=int,
        default=3,
        metavar="N",
        help="delivery retries of an alert when Slack fails (default 3)",
    )
    p.add_argument(
        "--alert-retry-delay",
        default="30s",
        metavar="DURATION",
        help="wait between delivery retries (default 30s)",
    )
    p.add_argument(
        "--controller-restarts",
        type=int,
        default=3,
        metavar="N",
        help="rerun a training run whose controller died at most N times per job within "
        "--restart-window, then alert that it gave up (default 3; 0: never)",
    )
    p.add_argument(
        "--zombie-after",
        default="90s",
        metavar="DURATION",
        help="mark a training run Crashed after this long without a heartbeat (default 90s, "
        "at least 60s: runs beat every 30 s)",
    )
    p.add_argument(
        "--missed-run-after",
        metavar="DURATION",
        help="alert when a scheduled training run has not finished this long after its slot, e.g. 6h "
        "(default: its schedule's period, so before the next slot)",
    )
    p.add_argument("--json", action="store_true", help="print what was applied as JSON")


def add_deploy(sub: Subparsers) -> None:
    help_ = (
        "apply the deployments (deployments/prefect.yaml) and alert automations to PREFECT_API_URL, "
        "else the background server (spotrun server start)"
    )
    p = sub.add_parser("deploy", help=help_, description=help_ + "; running it twice changes nothing")
    _alert_flags(p)
    p.set_defaults(handler=cmd_deploy)


def add_serve(sub: Subparsers) -> None:
    help_ = "deploy, then run a worker here that executes deployment runs (UI, schedules, alerts)"
    p = sub.add_parser(
        "serve", help=help_, description=help_ + "; starts a local server if PREFECT_API_URL is unset"
    )
    _alert_flags(p)
    p.add_argument("--poll", type=float, default=5.0, metavar="S", help="how often the worker asks for runs")
    p.set_defaults(handler=cmd_serve)
