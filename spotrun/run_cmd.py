"""`spotrun run`: one flow run of a job in this process, with a live view of its progress."""

from __future__ import annotations

import argparse
import logging
import os
import shlex
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from pydantic import BaseModel, ValidationError
from rich.console import Console
from rich.markup import escape

from spotrun.trainer.errors import ConfigError, StorageError
from spotrun.trainer.spec.job import JobSpec, load_spec

if TYPE_CHECKING:  # imported where used: `spotrun checkpoints` must not load SQLAlchemy or Prefect
    from spotrun.server import PrefectApi
    from spotrun.tasks.decisions.policy import RetryPolicy
    from spotrun.tasks.history import AttemptRow
    from spotrun.tasks.market.prices import Prices
    from spotrun.tasks.providers.registry import ProviderConfig
    from spotrun.tasks.settings import Settings

from spotrun.console import (
    EXIT_FAILED,
    EXIT_INTERRUPTED,
    EXIT_OK,
    Subparsers,
    attempts_table,
    one_line,
    spotrun_command,
    wide_console,
)
from spotrun.live import LiveView, RunMonitor

log = logging.getLogger(__name__)


# ---- run: one flow run of a job in this process, with a live view of its progress ----

SCHEDULE_HELP = (
    "seconds of training before each attempt's reclaim, e.g. 30,45:kill,60 (S:kill: without notice)"
)
FLAGS = {  # model field -> the flag that sets it, so a validation error names what the user typed
    "storage": "--storage",
    "total_steps": "--total-steps",
    "mean_interval_s": "--preempt-every",
    "after_s": "--preempt-at",
    "no_notice_fraction": "--no-notice-fraction",
    "notice_s": "--notice-s",
    "max_errors": "--max-errors",
    "max_preemptions": "--max-preemptions",
}
_M = TypeVar("_M", bound=BaseModel)


def cmd_run(args: argparse.Namespace) -> int:
    """`spotrun run`: train a job through the resilient-training flow; exit 0 Completed, 1 Failed. A keyed
    job runs its keys one after another (a backfill), the exit code the worst of them."""
    job, provider, policy = run_inputs(args)  # every input checked before a server starts
    from spotrun.tasks.retraining.run_keys import keys_to_run

    codes = []
    for key in keys_to_run(job, args.run_key):
        codes.append(run_one(args, job, key, provider=provider, policy=policy))
        if codes[-1] == EXIT_INTERRUPTED:  # Ctrl-C stops the backfill too; the same command goes on
            break
    return max(codes, key=[EXIT_OK, EXIT_FAILED, EXIT_INTERRUPTED].index)


def run_one(
    args: argparse.Namespace,
    spec: JobSpec,
    run_key: str | None,
    *,
    provider: ProviderConfig,
    policy: RetryPolicy,
) -> int:
    """One flow run of the job (of one run key)."""
    from spotrun.server import prefect_api
    from spotrun.tasks.control.checkpoints import completed_at
    from spotrun.tasks.history.engine import (
        check_database_url,  # SQLAlchemy: 0.65 s, after the job file's check
    )
    from spotrun.tasks.ownership import adoption
    from spotrun.tasks.retraining.run_keys import preview
    from spotrun.tasks.settings import Settings
    from spotrun.trainer.storage import check_local_path

    settings = Settings.from_env()
    job = settings.resolve(
        preview(spec, run_key)
    )  # the key's storage and directories; the flow resolves the rest
    check_local_path(job.storage)
    check_database_url(settings.database_url)
    out = wide_console()
    which = f"job {job.name}" + (f" run key {run_key}" if run_key else "")
    # a storage that refuses, cannot be reached or holds another finished job: one line, exit 2; not
    # when a dead controller's job run waits to be adopted (the flow closes it, finished or not)
    adopting = adoption.read_controller(settings.job_dir(job.name, job.run_key)) is not None
    done = None if adopting else completed_at(job)
    if done is not None:  # no server, no flow run, no history row for a run with nothing to do
        out.print(
            f"{which} already completed at step {done} in {job.storage}: nothing to run "
            "(a larger --total-steps trains on; a new --storage starts over)",
            markup=False,
        )
        return EXIT_OK
    _check_deadline(job, settings.database_url, out, prices=_known_prices(provider))
    with prefect_api(settings.home, background="no" if args.temporary_server else "start") as api:
        out.print(server_line(api), markup=False)
        out.print(f"flow run of {which} against {api.url}; checkpoints in {job.storage}", markup=False)
        try:
            result = run_job(spec, provider, policy, settings=settings, out=out, job=job)
        except KeyboardInterrupt:  # the flow stopped its trainer (emergency checkpoint) and recorded it
            print_interrupted(out, settings, job)
            return EXIT_INTERRUPTED
        print_result(out, result, api.flow_run_url(result.flow_run_id))
    if api.server is not None:
        out.print(
            "the temporary Prefect server has stopped, and the flow run link with it; "
            f"`{spotrun_command()} server start` keeps one running",
            markup=False,
        )
    last = result.attempts[-1] if result.attempts else None
    if not result.completed and last is not None and last.trainer_code == "CONFIG_ERROR":
        # bad input the trainer found (a recipe that cannot be built): exit 2 with its one line, like ours
        raise ConfigError(f"attempt {last.attempt}: {last.error.removeprefix('ConfigError: ')}")
    return EXIT_OK if result.completed else EXIT_FAILED


def server_line(api: PrefectApi) -> str:
    """Which Prefect server this run is recorded in, and for how long its links work."""
    if api.source == "env":
        return f"Prefect server: {api.url} (PREFECT_API_URL)"
    if api.source == "background":
        how = "started in the background" if api.started else "background"
        stop = f"{spotrun_command()} server stop"
        return f"Prefect server: {api.ui_url} ({how}; it keeps running after this run: {stop})"
    return f"Prefect server: {api.ui_url} (temporary: it stops when this run ends)"


def run_inputs(args: argparse.Namespace) -> tuple[JobSpec, ProviderConfig, RetryPolicy]:
    """The job (with overrides), provider and retry policy of `spotrun run`, each validated."""
    from spotrun.tasks.decisions.policy import RetryPolicy
    from spotrun.tasks.providers.local import LocalProviderConfig, SpotSimulatorConfig

    spec = load_spec(args.job)
    updates = {
        k: v for k, v in (("storage", args.storage), ("total_steps", args.total_steps)) if v is not None
    }
    if updates:
        spec = _validated(JobSpec, {**spec.model_dump(mode="json"), **updates})
    if args.no_notice_fraction is not None and args.preempt_every is None:
        raise ConfigError("--no-notice-fraction applies to --preempt-every; in --preempt-at write S:kill")
    sim: dict[str, Any] = {"mean_interval_s": args.preempt_every, "schedule": parse_schedule(args.preempt_at)}
    if args.no_notice_fraction is not None:
        sim["no_notice_fraction"] = args.no_notice_fraction
    notice = {} if args.notice_s is None else {"notice_s": args.notice_s}
    provider: ProviderConfig
    if args.provider is not None:
        provider = load_provider(args.provider)
        simulated = "simulator" in type(provider).model_fields  # what the flags set
        if not simulated and (sim["mean_interval_s"] or sim["schedule"] or notice):
            raise ConfigError(
                f"--preempt-*/--notice-s drive the local spot simulator; drop them for kind {provider.kind}"
            )
    else:
        provider = _validated(
            LocalProviderConfig, {"simulator": _validated(SpotSimulatorConfig, sim), **notice}
        )
    budgets = {k: getattr(args, k) for k in ("max_errors", "max_preemptions") if getattr(args, k) is not None}
    if spec.recipe is not None:
        check_recipe(spec.recipe, spec.args, local=provider.workers_here)
    from spotrun.tasks.admission.trust import signing_refusal

    if (why := signing_refusal(spec, provider, os.environ)) is not None:
        raise ConfigError(why)
    if provider.workers_here:  # last: it imports the entry point's module (and torch) in a subprocess
        check_entrypoint(spec, provider.python)
    return spec, provider, _validated(RetryPolicy, budgets)


def check_recipe(name: str, args: dict[str, Any], local: bool) -> None:
    """ConfigError now, not after a worker crashed on it: an unknown built-in name, or an arg it does
    not take, always; a `module:function` that does not import (or its args) only for local workers
    (EC2 images may hold what this machine lacks)."""
    from spotrun.trainer import recipes

    if local or ":" not in name:
        recipes.check_args(name, args)


def check_entrypoint(spec: JobSpec, python: str | None) -> None:
    """ConfigError now, not after a worker crashed on it: a local job's entry point that does not import
    with a local worker's interpreter and path, or sits beside a module named like spotrun's packages.
    Imported in a subprocess (tasks/admission/entrypoint_check.py): this process loads no user code."""
    from spotrun.tasks.admission.entrypoint_check import entrypoint_refusal

    if (why := entrypoint_refusal(spec, python, os.environ, Path.cwd())) is not None:
        raise ConfigError(why)


def load_provider(path: str) -> ProviderConfig:
    """A provider settings file (YAML, `kind: local` or `kind: aws`), validated; ConfigError otherwise."""
    import yaml

    from spotrun.tasks.providers.registry import kinds, parse_provider_config

    try:
        data = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as e:
        raise ConfigError(f"cannot read provider file {path}: {one_line(e)}") from None
    if not isinstance(data, dict) or "kind" not in data:
        raise ConfigError(f"{path}: a mapping with {kinds()} and its settings")
    try:
        return parse_provider_config(data)
    except ValidationError as e:
        err = e.errors()[0]
        where = ".".join(str(p) for p in err["loc"][1:]) or "kind"  # loc[0] is the kind's tag
        raise ConfigError(f"{path}: {where}: {err['msg']}") from None


def parse_schedule(text: str | None) -> list[dict[str, Any]]:
    """`--preempt-at 30,45:kill,60` as planned reclaims: one per attempt, `:kill` without notice."""
    if not text:
        return []
    plan = []
    for item in text.split(","):
        seconds, _, how = item.strip().partition(":")
        try:
            after = float(seconds)
        except ValueError:
            raise ConfigError(f"--preempt-at {text!r}: {SCHEDULE_HELP}") from None
        if how not in ("", "kill", "notice"):
            raise ConfigError(f"--preempt-at {text!r}: unknown mode {how!r}; {SCHEDULE_HELP}")
        plan.append({"after_s": after, "notice": how != "kill"})
    return plan


def _validated(model: type[_M], values: dict[str, Any]) -> _M:
    try:
        return model.model_validate(values)
    except ValidationError as e:
        err = e.errors()[0]
        names = [str(p) for p in err["loc"]]
        flag = next((FLAGS[n] for n in names if n in FLAGS), ".".join(names))
        raise ConfigError(f"{flag} {err.get('input')!r}: {err['msg']}") from None


@dataclass
class RunResult:
    completed: bool
    message: str  # the final state's message: why it gave up, or how it completed
    summary: dict[str, Any]  # the flow's Summary (goodput, wall_s, timeline, ...); {} if it crashed
    attempts: list[AttemptRow]
    flow_run_id: str | None
    metrics: Path  # the trainer's per-step losses, every attempt appended (the last value per step counts)


def run_job(
    spec: JobSpec,
    provider: ProviderConfig,
    policy: RetryPolicy,
    *,
    settings: Settings,
    out: Console,
    job: JobSpec | None = None,
) -> RunResult:
    """Run the resilient-training flow in this process (against the current Prefect API) with a live view.
    Per-step progress comes from local workers' metrics files; EC2 workers show their attempts only.
    `job`: the spec as resolved for its run key (its storage and directories), where it has one."""
    from spotrun.flows.resilient_training import resilient_training
    from spotrun.tasks.history import HistoryStore
    from spotrun.tasks.providers.local import worker_dir

    job = job or spec
    workdir = provider.workers_dir(settings.job_dir(job.name, job.run_key) / "workers")
    provider = provider.placed(workdir)
    # Migrated (and its journal replayed) here, before the flow and the view share it.
    store = HistoryStore.open(settings.database_url, journal_dir=settings.journal_dir)
    metrics = worker_dir(workdir, job) / "metrics.jsonl"
    monitor = RunMonitor(store, job.name, metrics, since=time.time(), run_key=job.run_key)
    with _prefect_console(logging.ERROR), LiveView(out, monitor, job.total_steps):
        state = resilient_training(spec, provider, policy, job.run_key, return_state=True)
    data = state.result(raise_on_failure=False)
    flow_run_id = state.state_details.flow_run_id
    if not monitor.history_error:  # closing a store whose database is down only repeats its warning
        store.close()
    return RunResult(
        state.is_completed(),
        state.message or "",
        data if isinstance(data, dict) else {},
        attempts=monitor.attempts,
        flow_run_id=str(flow_run_id) if flow_run_id else None,
        metrics=monitor.metrics,
    )


_INTERRUPT_CRASH = "Crash detected! Execution was aborted by an interrupt signal"


class _PrefectBelow(logging.Filter):
    """Drops records of Prefect's loggers below a level."""

    def __init__(self, level: int) -> None:
        super().__init__()
        self.level = level

    def filter(self, record: logging.LogRecord) -> bool:
        if not record.name.startswith("prefect"):
            return True
        # a Ctrl-C: Prefect reports every run it aborted as a crash, at ERROR; this command says what
        # happened in its own lines (print_interrupted), and the runs' pages keep Prefect's
        return record.levelno >= self.level and not record.getMessage().startswith(_INTERRUPT_CRASH)


@contextmanager
def _prefect_console(level: int) -> Iterator[None]:
    """Prefect's records below `level` kept off the terminal for the body: the flow's INFO lines (every
    worker log line among them) still reach the API and the UI through Prefect's own handlers."""
    quiet = _PrefectBelow(level)
    handlers = list(logging.getLogger().handlers)  # Prefect's console handler, or the one main() set
    for h in handlers:
        h.addFilter(quiet)
    try:
        yield
    finally:
        for h in handlers:
            h.removeFilter(quiet)


def print_result(out: Console, r: RunResult, flow_run_url: str) -> None:
    """The attempts table, the final message, goodput, the timeline and the flow run's page."""
    if r.attempts:
        out.print(attempts_table(r.attempts, "attempts (from the SQL history)"))
    color = "green" if r.completed else "red"
    out.print(f"[bold {color}]{'Completed' if r.completed else 'Failed'}[/]: {escape(r.message)}")
    s = r.summary
    if s:
        out.print(
            f"goodput {s['goodput']:.1%} (productive time / wall time {s['wall_s']:.1f} s)\n"
            f"timeline: {s['timeline']}",
            markup=False,
        )
        for line in tracking_lines(s):
            out.print(line, markup=False)
    if r.flow_run_id:
        out.print(f"flow run: {flow_run_url}", markup=False)


def tracking_lines(summary: dict[str, Any]) -> list[str]:
    """The summary's resume checks and MLflow run, as `spotrun run` and the demo print them."""
    lines = [f"run key: {summary['run_key']}"] if summary.get("run_key") else []
    if p := summary.get("promotion"):
        lines.append(
            f"promotion ({p.get('alias')} {'moved' if p.get('promoted') else 'kept'}): {p.get('reason')}"
        )
    checks = summary.get("resume_checks") or []
    if checks:
        each = "; ".join(f"attempt {c['attempt']} {c['verdict']} ({c['method']})" for c in checks)
        lines.append(f"resume fidelity: {summary.get('resume_fidelity')}: {each}")
    m = summary.get("mlflow")
    if m and m.get("run_id"):
        model = f", model {m['model']}" if m.get("model") else ""
        lines.append(f"MLflow run {m['run_id']} in experiment {m['experiment']}{model}: {m['url']}")
        if not str(m["tracking_uri"]).startswith("http"):
            lines.append(f"  to browse it: mlflow ui --backend-store-uri {m['tracking_uri']}")
        if m.get("pending"):
            lines.append(
                f"  MLflow has the metrics through step {m['sent_through']}; the rest wait in storage"
            )
    elif m:
        lines.append(f"MLflow at {m['tracking_uri']} did not answer; the metrics wait in the job's storage")
    return lines


def print_interrupted(out: Console, settings: Settings, job: JobSpec) -> None:
    """After Ctrl-C: the job run's attempts and end as SQL has them, and the command that resumes it."""
    from spotrun.tasks.history import HistoryStore, StoreUnavailable

    store = HistoryStore.open(settings.database_url, journal_dir=settings.journal_dir)
    try:
        run = store.latest_job_run(job.name, job.run_key)
        rows = store.attempts(job_run_id=run.id, limit=10_000) if run is not None else []
    except StoreUnavailable as e:
        run, rows = None, []
        out.print(f"history unavailable ({one_line(e)}); it is kept in the journal", markup=False)
    finally:
        store.close()
    if rows:
        out.print(attempts_table(rows, "attempts (from the SQL history)"))
    status = f"{run.status.value}: {run.message}" if run is not None else "interrupted"
    out.print(f"[bold yellow]Interrupted[/]: {escape(status)}")
    out.print(f"resume with: {spotrun_command()} {shlex.join(sys.argv[1:])}", markup=False)


def add_run(sub: Subparsers) -> None:
    help_ = "train a job through the resilient-training flow here, with a live progress view"
    epilog = (
        "The flow runs in this process against PREFECT_API_URL, or else the background Prefect server "
        "(`spotrun server`; started here if it is not running, and left running so the flow run's link "
        "keeps working; --temporary-server: one for this run alone). A relative storage is under "
        "$SPOTRUN_HOME. Workers are local trainer processes, reclaimed by "
        "the spot simulator as the --preempt-* options say, or EC2 spot instances (--provider with kind "
        "aws). Exit 0 Completed, 1 Failed, 2 bad input, 130 interrupted (Ctrl-C: the trainer takes an "
        "emergency checkpoint first; the same command resumes)."
    )
    p = sub.add_parser("run", help=help_, description=help_, epilog=epilog)
    p.add_argument("job", metavar="JOB.yaml", help="the job spec")
    p.add_argument("--storage", metavar="URI", help="override the spec's storage (directory or s3://...)")
    p.add_argument("--total-steps", type=int, metavar="N", help="override the spec's total_steps")
    p.add_argument(
        "--run-key",
        metavar="KEY[..KEY]",
        help="a keyed job (run_key in the spec): run or continue this key, e.g. 2026-12-01 (that night's "
        "data); FIRST..LAST: each date key in turn (a backfill); default: today's key",
    )
    when = p.add_mutually_exclusive_group()
    when.add_argument(
        "--preempt-every", type=float, metavar="S", help="random reclaims, mean S s of training"
    )
    when.add_argument("--preempt-at", metavar="S[,S...]", help=SCHEDULE_HELP)
    p.add_argument(
        "--no-notice-fraction", type=float, metavar="F", help="share of random reclaims without notice"
    )
    p.add_argument("--notice-s", type=float, metavar="S", help="seconds from a notice to the hard kill")
    p.add_argument("--max-errors", type=int, metavar="N", help="give up at this many crashes or lost workers")
    p.add_argument("--max-preemptions", type=int, metavar="N", help="give up at this many preemptions")
    p.add_argument(
        "--provider", metavar="FILE.yaml", help="provider settings: kind local (default) or aws (docs/aws.md)"
    )
    p.add_argument(
        "--temporary-server",
        action="store_true",
        help="without PREFECT_API_URL: a Prefect server for this run alone, stopped after it (dead links)",
    )
    p.set_defaults(handler=cmd_run)


def _known_prices(provider: ProviderConfig) -> Prices | None:
    """The prices a provider's settings name (the local trace replay's), without asking any cloud: EC2's
    come from its API, which the flow's check asks."""
    from spotrun.tasks.providers.local import LocalProviderConfig

    return provider.prices() if isinstance(provider, LocalProviderConfig) else None


def _check_deadline(job: JobSpec, database_url: str, out: Any, *, prices: Prices | None = None) -> None:
    """A deadline or budget the job cannot meet even on on-demand is refused before anything starts: one
    line, exit 2 (the flow checks again, with what it measures and the provider's prices)."""
    if job.deadline is None and job.budget_usd is None:
        return
    from spotrun.tasks.deadlines.plan import measure, submission_problem
    from spotrun.tasks.history.store import HistoryStore
    from spotrun.trainer.checkpoint.catalog import read_latest

    store = HistoryStore.open(database_url)
    try:
        history = store.attempts(job=job.name)
    finally:
        store.close()
    try:
        done = read_latest(job.open_storage(create=False)) or 0
    except (OSError, StorageError):
        done = 0
    now = time.time()
    problem, warning = submission_problem(
        job, now=now, start=now, done_step=done, measured=measure(job, history), prices=prices
    )
    if warning is not None:
        out.print(f"warning: {warning}", markup=False)
    if problem is not None:
        raise ConfigError(f"refused: {problem}")
