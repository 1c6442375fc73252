"""`spotrun`: the command line, the outermost face of the project (it imports the rest; nothing imports it).

Each top-level command registers itself in `COMMANDS`; a handler returns the exit code. Expected
errors (a bad spec, a missing bucket) become one line on stderr and exit 2, never a traceback.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import torch
from pydantic import BaseModel, ValidationError
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table
from sqlalchemy import exc as sa_exc

from trainer import recipes
from trainer.catalog import fetch, list_checkpoints, read_latest
from trainer.ckpt_format import load_part, step_dir
from trainer.errors import ConfigError, SpotrunError
from trainer.recipes import RecipeContext
from trainer.spec import JobSpec, S3Options, load_spec, parse_spec
from trainer.storage import Storage, open_storage
from trainer.validate import Expectation, Problem, read_manifest, validate_dir

if TYPE_CHECKING:  # imported where used: `checkpoints` needs neither SQLAlchemy models nor Prefect
    from tasks.history import AttemptRow, HistoryStore, JobRunRow
    from tasks.policy import RetryPolicy
    from tasks.providers.local import LocalProviderConfig
    from tasks.settings import Settings

log = logging.getLogger(__name__)

EXIT_OK, EXIT_FINDINGS, EXIT_ERROR = 0, 1, 2
EXIT_FAILED = 1  # `spotrun run`: the flow run ended Failed

Handler = Callable[[argparse.Namespace], int]
Subparsers = Any  # argparse's _SubParsersAction is private


# ---- checkpoints: what a storage root holds, and whether it is safe to resume from ----


@dataclass
class Row:
    """One step directory as `checkpoints list` reports it."""

    step: int
    size: int
    committed: bool
    latest: bool
    problems: list[Problem] = field(default_factory=list)
    metrics: dict[str, float] = field(default_factory=dict)

    @property
    def valid(self) -> bool:
        return self.committed and not self.problems

    def to_json(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "size": self.size,
            "committed": self.committed,
            "latest": self.latest,
            "valid": self.valid,
            "problems": [{"kind": p.kind, "file": p.file, "detail": p.detail} for p in self.problems],
            "metrics": self.metrics,
        }


class Expectations:
    """The structure a checkpoint must have: from --spec when given, else from the spec it carries.

    Built recipes are cached by shape hash: every checkpoint of one job shares one."""

    def __init__(self, spec: JobSpec | None) -> None:
        self.fixed = _expectation(spec) if spec is not None else None
        self._by_shape: dict[str, Expectation | None] = {}

    def for_dir(self, d: Path) -> Expectation | None:
        if self.fixed is not None:
            return self.fixed
        spec = _embedded_spec(d)
        if spec is None:
            return None
        key = spec.shape_hash()
        if key not in self._by_shape:
            try:
                self._by_shape[key] = _expectation(spec)
            except ConfigError as e:  # e.g. a user recipe not importable here: check integrity only
                log.info("not checking structure of %s against its recipe: %s", d.name, e)
                self._by_shape[key] = None
        return self._by_shape[key]


def _expectation(spec: JobSpec) -> Expectation:
    ctx = RecipeContext(spec.seed, spec.total_steps, spec.batch_size, torch.device("cpu"))
    parts = recipes.build(spec.recipe, spec.args, ctx)
    return Expectation.from_parts(parts.model, parts.optimizer, spec.shape_hash())


def _embedded_spec(d: Path) -> JobSpec | None:
    """The job spec stored in a checkpoint's trainer.pt, or None when it cannot be read."""
    try:
        meta = load_part(d / "trainer.pt")["state"]
        return parse_spec(meta["spec"], source=f"{d.name}/trainer.pt")
    except Exception:  # a damaged or foreign trainer.pt: validate_dir reports it; check without a recipe
        return None


def inspect_step(storage: Storage, step: int, cache: Path, expect: Expectations) -> list[Problem]:
    """Fetch one committed checkpoint into `cache` and validate it."""
    path = fetch(storage, step, cache)
    return validate_dir(path, expect.for_dir(path))


def list_rows(storage: Storage, cache: Path, expect: Expectations) -> list[Row]:
    """Every step directory under the storage root, newest first, each validated when committed."""
    latest = read_latest(storage)
    rows = []
    for step, listed in sorted(list_checkpoints(storage).items(), reverse=True):
        row = Row(step, sum(listed.files.values()), listed.committed, step == latest)
        if listed.committed:
            try:
                row.problems = inspect_step(storage, step, cache, expect)
            except FileNotFoundError:  # deleted by a running trainer's retention since the listing
                continue
            manifest, _ = read_manifest(cache / step_dir(step))
            row.metrics = manifest.metrics if manifest is not None else {}
        rows.append(row)
    return rows


def cmd_checkpoints_list(args: argparse.Namespace) -> int:
    """`spotrun checkpoints list`: a table (or JSON) of every checkpoint and whether it is valid."""
    with _checkpoint_context(args) as (storage, cache, expect):
        rows = list_rows(storage, cache, expect)
    if args.json:
        print(json.dumps([r.to_json() for r in rows], indent=2))
    else:
        print_rows(storage.uri, rows)
    return EXIT_OK


def cmd_checkpoints_verify(args: argparse.Namespace) -> int:
    """`spotrun checkpoints verify`: exit 0 only when the newest committed checkpoint is valid."""
    with _checkpoint_context(args) as (storage, cache, expect):
        listed = list_checkpoints(storage)
        committed = sorted((s for s, c in listed.items() if c.committed), reverse=True)
        if not committed:
            partial = f" ({len(listed)} incomplete step directories)" if listed else ""
            print(f"no committed checkpoint in {storage.uri}{partial}")
            return EXIT_FINDINGS
        step = committed[0]
        problems = inspect_step(storage, step, cache, expect)
    if not problems:
        print(f"step {step} in {storage.uri}: valid")
        return EXIT_OK
    for p in ranked(problems):
        print(f"step {step}: {p.kind}: {p}")
    return EXIT_FINDINGS


@contextmanager
def _checkpoint_context(args: argparse.Namespace) -> Iterator[tuple[Storage, Path, Expectations]]:
    spec = load_spec(args.spec) if args.spec else None
    uri = args.uri or (spec.storage if spec is not None else None)
    if uri is None:
        raise ConfigError("give a storage URI (a directory or s3://bucket/prefix), or --spec JOB.yaml")
    s3 = spec.s3 if spec is not None else S3Options()
    updates = {k: v for k, v in (("endpoint_url", args.endpoint_url), ("region", args.region)) if v}
    storage = open_storage(uri, s3.model_copy(update=updates), create=False)
    expect = Expectations(spec)
    with tempfile.TemporaryDirectory(prefix="spotrun-ckpt-") as cache:
        yield storage, Path(cache), expect


def print_rows(uri: str, rows: list[Row]) -> None:
    """Render `checkpoints list` as a table."""
    out = wide_console()
    if not rows:
        out.print(f"no checkpoints in {uri}", markup=False)
        return
    table = Table(title=f"checkpoints in {escape(uri)}", title_justify="left")
    for name in ("step", "size"):
        table.add_column(name, justify="right")
    for name in ("committed", "latest", "valid", "metrics"):
        table.add_column(name, overflow="fold")
    for r in rows:
        if not r.committed:
            valid = "[yellow]- (no manifest: partial write)[/]"
        elif r.valid:
            valid = "[green]yes[/]"
        else:
            valid = f"[red]no: {escape(_summary(r.problems))}[/]"
        metrics = " ".join(f"{k}={v:.4g}" for k, v in sorted(r.metrics.items()))
        committed = "yes" if r.committed else "no"
        table.add_row(str(r.step), _size(r.size), committed, "latest" if r.latest else "", valid, metrics)
    out.print(table)


def _summary(problems: list[Problem], most: int = 3) -> str:
    shown = "; ".join(str(p) for p in ranked(problems)[:most])
    return shown + (f" (+{len(problems) - most} more)" if len(problems) > most else "")


def ranked(problems: list[Problem]) -> list[Problem]:
    """Problems in the order that explains them: a different job's checkpoint first, then damage."""
    order = {"compat": 0, "integrity": 1, "structure": 2, "content": 3}
    return sorted(problems, key=lambda p: order[p.kind])


def wide_console() -> Console:
    """A rich console that does not fold piped output (logs, CI, tests) to 80 columns."""
    return Console(highlight=False, width=None if sys.stdout.isatty() else 160)


def _size(n: int) -> str:
    if n < 1024:
        return f"{n} B"
    size, units = n / 1024, ["KiB", "MiB", "GiB", "TiB"]
    while size >= 1024 and len(units) > 1:
        size, units = size / 1024, units[1:]
    return f"{size:.1f} {units[0]}"


def _add_checkpoints(sub: Subparsers) -> None:
    p = sub.add_parser("checkpoints", help="list and verify the checkpoints under a storage URI")
    actions = p.add_subparsers(dest="action", required=True, metavar="ACTION")
    for name, handler, help_ in (
        ("list", cmd_checkpoints_list, "every step directory, its size, validity and metrics"),
        ("verify", cmd_checkpoints_verify, "exit 0 only when the newest committed checkpoint is valid"),
    ):
        q = actions.add_parser(name, help=help_, description=help_)
        q.add_argument(
            "uri", nargs="?", help="directory, file:// URI or s3://bucket/prefix (default: the spec's)"
        )
        q.add_argument("--spec", metavar="JOB.yaml", help="check structure against this job's recipe")
        q.add_argument("--endpoint-url", help="S3-compatible endpoint (credentials from the environment)")
        q.add_argument("--region", help="S3 region")
        if name == "list":
            q.add_argument("--json", action="store_true", help="print a JSON list instead of a table")
        q.set_defaults(handler=handler)


# ---- run: one flow run of a job in this process, with a live view of its progress ----

POLL_S = 0.5  # how often the live view reads the metrics file and the SQL history
TRAINING_GAP_S = 2.0  # no step for this long: the worker is starting, restoring or gone
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
    """`spotrun run`: train a job through the resilient-training flow; exit 0 Completed, 1 Failed."""
    from spotrun.server import prefect_api
    from tasks.settings import Settings

    job, provider, policy = run_inputs(args)  # every input checked before a server starts
    settings = Settings.from_env()
    out = wide_console()
    if not os.environ.get("PREFECT_API_URL"):
        out.print(f"PREFECT_API_URL is unset: starting a Prefect server under {settings.home / 'prefect'}")
    with prefect_api(settings.home) as api:
        out.print(f"flow run of job {job.name} against {api.url}", markup=False)
        result = run_job(job, provider, policy, settings, out)
        print_result(out, result, api.flow_run_url(result.flow_run_id))
    if api.server is not None:
        out.print("the Prefect server has stopped; set PREFECT_API_URL to a running one to keep flow runs")
    return EXIT_OK if result.completed else EXIT_FAILED


def run_inputs(args: argparse.Namespace) -> tuple[JobSpec, LocalProviderConfig, RetryPolicy]:
    """The job (with overrides), provider and retry policy of `spotrun run`, each validated."""
    from tasks.policy import RetryPolicy
    from tasks.providers.local import LocalProviderConfig, SpotSimulatorConfig

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
    provider = _validated(LocalProviderConfig, {"simulator": _validated(SpotSimulatorConfig, sim), **notice})
    budgets = {k: getattr(args, k) for k in ("max_errors", "max_preemptions") if getattr(args, k) is not None}
    return spec, provider, _validated(RetryPolicy, budgets)


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


class RunMonitor:
    """Follows one job run from outside the flow, through two outputs that are contracts, not log text:
    the trainer's --metrics file (one JSON line per step, appended by every attempt of the job; the
    local provider writes it to <workdir>/<job>/metrics.jsonl) for the step and loss, and the SQL
    history for the job run (its flow run id) and each attempt once the flow has recorded it."""

    def __init__(self, store: HistoryStore, job: str, metrics: Path, since: float) -> None:
        self.store, self.job, self.metrics, self.since = store, job, metrics, since
        self.offset = metrics.stat().st_size if metrics.exists() else 0  # earlier runs' lines
        self.partial = b""
        self.step, self.loss, self.stepped_at = 0, float("nan"), 0.0
        self.job_run: JobRunRow | None = None
        self.attempts: list[AttemptRow] = []
        self.history_error = ""

    def poll(self) -> list[AttemptRow]:
        """Read what is new; returns the attempts recorded since the last poll."""
        from tasks.history import StoreUnavailable

        self._read_metrics()
        try:
            return self._read_history()
        except StoreUnavailable as e:  # training goes on while the database is down (the flow buffers)
            self.history_error = _one_line(e)
            return []

    @property
    def attempt(self) -> int:
        return len(self.attempts) + 1

    def phase(self) -> str:
        """What the current attempt is doing, and how the previous one ended."""
        now = time.monotonic()
        doing = (
            f"training, loss {self.loss:.4f}"
            if now - self.stepped_at < TRAINING_GAP_S
            else "starting a worker" if not self.attempts else "restarting: worker start-up and restore"
        )  # fmt: skip
        if self.history_error:
            return f"{doing} | history: {self.history_error}"
        last = self.attempts[-1] if self.attempts else None
        return doing if last is None else f"{doing} | attempt {last.attempt} {last.outcome.value}"

    def _read_metrics(self) -> None:
        try:
            with open(self.metrics, "rb") as f:
                if f.seek(0, os.SEEK_END) < self.offset:  # recreated: read it from the start
                    self.offset, self.partial = 0, b""
                f.seek(self.offset)
                data = f.read()
        except FileNotFoundError:
            return
        self.offset += len(data)
        *lines, self.partial = (self.partial + data).split(b"\n")
        for line in lines:
            rec = metrics_record(line.decode("utf-8", errors="replace"))
            if rec is not None:
                self.step, self.loss, self.stepped_at = rec[0], float.fromhex(rec[1]), time.monotonic()

    def _read_history(self) -> list[AttemptRow]:
        if self.job_run is None:
            runs = [r for r in self.store.job_runs(self.job, limit=5) if r.started_at >= self.since - 1]
            if not runs:
                return []
            self.job_run = runs[0]
        rows = self.store.attempts(job_run_id=self.job_run.id, limit=10_000)
        new, self.attempts = rows[len(self.attempts) :], rows
        self.history_error = ""
        if new:
            self.stepped_at = 0.0  # the steps read so far were the ended attempt's
        return new


def metrics_record(line: str) -> tuple[int, str] | None:
    """(step, loss as float.hex) from a metrics line. A SIGKILLed attempt may leave its last line cut
    short, and the next attempt's first line then continues it: the last record in a line counts."""
    start = line.rfind('{"step"')
    try:
        rec = json.loads(line[start:]) if start >= 0 else None
        if not isinstance(rec, dict):
            return None
        float.fromhex(rec["loss"])
        return int(rec["step"]), rec["loss"]
    except (ValueError, KeyError, TypeError):
        return None


class LiveView:
    """A progress bar of steps with the current attempt and what it is doing, refreshed by a thread
    every POLL_S, and one printed line per attempt as the history records it. On a terminal the bar
    updates in place; piped output gets the attempt lines and the bar's final state."""

    def __init__(self, out: Console, monitor: RunMonitor, total_steps: int) -> None:
        self.monitor, self.total = monitor, total_steps
        self.progress = Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("steps"),
            TimeElapsedColumn(),
            TextColumn("{task.fields[phase]}"),
            console=out,
        )
        self.task = self.progress.add_task("attempt 1", total=total_steps, phase="starting a worker")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._follow, name="spotrun-live-view", daemon=True)

    def __enter__(self) -> LiveView:
        self.progress.start()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        try:
            # The flow records its last attempt before it returns: this read sees every one.
            if self._refreshed() and (attempts := self.monitor.attempts):
                phase = f"attempt {attempts[-1].attempt} {attempts[-1].outcome.value}"
                self.progress.update(self.task, description=f"{len(attempts)} attempt(s)", phase=phase)
        finally:
            self.progress.stop()

    def refresh(self) -> None:
        m = self.monitor
        for row in m.poll():
            self.progress.console.print(describe_attempt(row), markup=False, highlight=False)
        self.progress.update(
            self.task, completed=min(m.step, self.total), description=f"attempt {m.attempt}", phase=m.phase()
        )

    def _refreshed(self) -> bool:
        try:
            self.refresh()
        except Exception as e:  # only a convenience: a failure here must not touch the flow run
            log.warning("live view stopped: %s", _one_line(e))
            return False
        return True

    def _follow(self) -> None:
        while not self._stop.wait(POLL_S) and self._refreshed():
            pass


def describe_attempt(r: AttemptRow) -> str:
    frm = "scratch" if r.resumed_from is None else f"step {r.resumed_from}"
    return (
        f"attempt {r.attempt} {r.outcome.value}: {r.cause} (from {frm} to step {r.last_step}, "
        f"{r.lost_steps} steps lost, {r.wall_s:.1f} s)"
    )


@dataclass
class RunResult:
    completed: bool
    message: str  # the final state's message: why it gave up, or how it completed
    summary: dict[str, Any]  # the flow's Summary (goodput, wall_s, timeline, ...); {} if it crashed
    attempts: list[AttemptRow]
    flow_run_id: str | None
    metrics: Path  # the trainer's per-step losses, every attempt appended (the last value per step counts)


def run_job(
    job: JobSpec, provider: LocalProviderConfig, policy: RetryPolicy, settings: Settings, out: Console
) -> RunResult:
    """Run the resilient-training flow in this process (against the current Prefect API) with a live view."""
    from flows.resilient_training import resilient_training
    from tasks.history import HistoryStore

    workdir = Path(provider.workdir) if provider.workdir else settings.job_dir(job.name) / "workers"
    provider = provider.model_copy(update={"workdir": str(workdir)})
    store = HistoryStore.open(settings.database_url)  # migrated here, before the flow and the view share it
    monitor = RunMonitor(store, job.name, workdir / job.name / "metrics.jsonl", time.time())
    with _prefect_console(logging.ERROR), LiveView(out, monitor, job.total_steps):
        state = resilient_training(job, provider, policy, return_state=True)
    data = state.result(raise_on_failure=False)
    flow_run_id = state.state_details.flow_run_id
    if not monitor.history_error:  # closing a store whose database is down only repeats its warning
        store.close()
    return RunResult(
        state.is_completed(),
        state.message or "",
        data if isinstance(data, dict) else {},
        monitor.attempts,
        str(flow_run_id) if flow_run_id else None,
        monitor.metrics,
    )


class _PrefectBelow(logging.Filter):
    """Drops records of Prefect's loggers below a level."""

    def __init__(self, level: int) -> None:
        super().__init__()
        self.level = level

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= self.level or not record.name.startswith("prefect")


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
    if r.flow_run_id:
        out.print(f"flow run: {flow_run_url}", markup=False)


def attempts_table(rows: Sequence[AttemptRow], title: str, with_run: bool = False) -> Table:
    """Attempts as a rich table; `with_run` adds the job and (short) job-run id columns."""
    table = Table(title=escape(title), title_justify="left")
    names = ["job", "run"] if with_run else []
    names += ["attempt", "outcome", "cause", "resumed from", "last step", "lost steps", "wall s", "ended at"]
    numeric = {"attempt", "resumed from", "last step", "lost steps", "wall s"}
    for name in names:
        table.add_column(name, justify="right" if name in numeric else "left", overflow="fold")
    colors = {"completed": "green", "preempted": "yellow"}
    for r in rows:
        outcome = f"[{colors.get(r.outcome.value, 'red')}]{r.outcome.value}[/]"
        cells = [escape(r.job), r.job_run_id[:8]] if with_run else []
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


def _add_run(sub: Subparsers) -> None:
    help_ = "train a job through the resilient-training flow here, with a live progress view"
    epilog = (
        "The flow runs in this process against PREFECT_API_URL, or against a Prefect server started "
        "under $SPOTRUN_HOME/prefect for the run. Workers are local trainer processes, reclaimed by "
        "the spot simulator as the --preempt-* options say. Exit 0 Completed, 1 Failed, 2 bad input."
    )
    p = sub.add_parser("run", help=help_, description=help_, epilog=epilog)
    p.add_argument("job", metavar="JOB.yaml", help="the job spec")
    p.add_argument("--storage", metavar="URI", help="override the spec's storage (directory or s3://...)")
    p.add_argument("--total-steps", type=int, metavar="N", help="override the spec's total_steps")
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
    p.set_defaults(handler=cmd_run)


# ---- history: the attempts in SQL ----


def cmd_history(args: argparse.Namespace) -> int:
    """`spotrun history`: the newest attempts (of a job) from the SQL history, as a table or JSON."""
    from tasks.history import HistoryStore, StoreUnavailable
    from tasks.settings import Settings

    url = Settings.from_env().database_url
    try:
        store = None if _missing_sqlite(url) else HistoryStore.open(url)  # a read creates no database
        rows = store.attempts(job=args.job, limit=args.limit) if store is not None else []
    except (StoreUnavailable, ValueError, sa_exc.ArgumentError) as e:
        return _error(e)
    if store is not None:
        store.close()
    if args.json:
        print(json.dumps([asdict(r) for r in rows], indent=2, default=str))
    elif not rows:
        wide_console().print(
            f"no attempts{f' of {args.job}' if args.job else ''} in {_safe_url(url)}", markup=False
        )
    else:
        title = f"attempts{f' of {args.job}' if args.job else ''} (newest {len(rows)}, oldest first)"
        wide_console().print(attempts_table(rows, title, with_run=True))
    return EXIT_OK


def _missing_sqlite(url: str) -> bool:
    from tasks.history.store import normalize_url

    u = normalize_url(url)
    db = u.database
    return u.get_backend_name() == "sqlite" and db not in (None, "", ":memory:") and not Path(db).exists()


def _safe_url(url: str) -> str:
    from tasks.history.store import normalize_url

    return normalize_url(url).render_as_string(hide_password=True)


def _add_history(sub: Subparsers) -> None:
    help_ = "the attempts of past job runs, from the SQL history (SPOTRUN_DATABASE_URL)"
    p = sub.add_parser("history", help=help_, description=help_)
    p.add_argument("job", metavar="JOB", nargs="?", help="only this job's attempts")
    p.add_argument("--json", action="store_true", help="print a JSON list instead of a table")
    p.add_argument("--limit", type=int, default=50, metavar="N", help="the newest N attempts (default 50)")
    p.set_defaults(handler=cmd_history)


# ---- the command registry: `deploy` and `serve` are added here ----

COMMANDS: dict[str, Callable[[Subparsers], None]] = {
    "checkpoints": _add_checkpoints,
    "run": _add_run,
    "history": _add_history,
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
    handler: Handler = args.handler
    try:
        return handler(args)
    except (SpotrunError, OSError) as e:  # expected failures: one line, no traceback
        return _error(e)
    except KeyboardInterrupt:
        return 130


def _error(e: BaseException) -> int:
    print(f"spotrun: error: {_one_line(e)}", file=sys.stderr)
    return EXIT_ERROR


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split()) or type(e).__name__


if __name__ == "__main__":
    sys.exit(main())
