"""`python -m spotrun.trainer --config JOB.yaml`: run one training attempt. Exit codes: trainer/exitcodes.py.

With a `distributed` spec the same command starts this machine's ranks under torchrun
(trainer/launch/start.py) and each rank comes back here: `main` is then a rank, told apart by
torchrun's environment."""

from __future__ import annotations

import argparse
import contextlib
import functools
import logging
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from spotrun.trainer.checkpoint.format import parse_step_dir
from spotrun.trainer.command.runner import run_command
from spotrun.trainer.distributed.ranks import Ranks, rank_env
from spotrun.trainer.errors import (
    CheckpointError,
    ConfigError,
    LeaseHeld,
    LeaseLost,
    ResumeIncompatible,
    SpotrunError,
    StorageError,
    TrainingDiverged,
    TransientStorageError,
    is_echo,
)
from spotrun.trainer.exitcodes import ExitCode
from spotrun.trainer.home import spotrun_home
from spotrun.trainer.hooks.worker import StopSeen, ending_of, run_worker_hook
from spotrun.trainer.launch.start import (
    LAUNCHER_ID,
    RANK_EXITS,
    RankExit,
    die_with_agent,
    relay,
    start_ranks,
    under_torchrun,
    write_rank_exit,
)
from spotrun.trainer.preemption.handover import ANNOUNCE_S, Advert
from spotrun.trainer.preemption.lease import DEFAULT_TTL_S, Holder, held
from spotrun.trainer.preemption.notices import Notice, make_watcher
from spotrun.trainer.preemption.requests import StopRequest, install_signal_handlers
from spotrun.trainer.session.faults import Fault
from spotrun.trainer.session.loop import AttemptOptions, ResumeSource, _device, run_attempt
from spotrun.trainer.spec.job import JobSpec, load_spec, parse_spec
from spotrun.trainer.storage import Storage, resolve_uri
from spotrun.trainer.storage.base import local_dir_name
from spotrun.trainer.storage.locks import private_home
from spotrun.trainer.telemetry.heartbeat import HeartbeatWriter
from spotrun.trainer.telemetry.status import StatusReporter, open_status

log = logging.getLogger("spotrun.trainer")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m spotrun.trainer", description=__doc__)
    p.add_argument("--config", required=True, help="job spec YAML")
    p.add_argument("--storage", help="override the spec's storage URI")
    p.add_argument(
        "--max-steps", type=int, help="stop after this many steps in this attempt (with a checkpoint)"
    )
    p.add_argument("--resume-from", help="require resuming from this step (or a step_NNN directory URI)")
    p.add_argument(
        "--skip-steps",
        action="append",
        default=[],
        metavar="N@STEP",
        help="when resuming from checkpoint STEP, skip the data of the next N steps (a rollback after a "
        "loss spike: tasks/control/rollback.py); repeatable",
    )
    p.add_argument(
        "--allow-changes",
        action="store_true",
        help="resume a checkpoint made with other training settings (seed, batch_size, amp, recipe args "
        "that do not shape the model), like resume.allow_changes: true in the spec; not bitwise from here",
    )
    p.add_argument(
        "--status",
        default="-",
        metavar="DEST",
        help="where the status records (`@spotrun {json}` lines) go: - (stdout, the default), fd:N (a "
        "descriptor the supervisor passed) or a file to append to; the log stays on stderr",
    )
    p.add_argument(
        "--cache", help="local checkpoint directory (default $SPOTRUN_HOME/cache/<job>-<storage hash>)"
    )
    p.add_argument("--metrics", help="append per-step losses as JSON lines to this file")
    p.add_argument(
        "--prewarm-wait",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="started early (at a spot notice): build the recipe, then wait up to this long for the "
        "storage lease that the worker being replaced gives back once its checkpoint is durable",
    )
    p.add_argument(
        "--handover-s",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="at a cloud notice, train on for up to this long until the replacement the controller "
        "started stands by, then checkpoint and stop (never past what the notice's deadline leaves for "
        "the checkpoint); 0: stop at the next step. A SIGTERM hands over only with --sigterm-window-s; "
        "Ctrl-C always stops at once",
    )
    p.add_argument(
        "--announce-s",
        type=float,
        default=ANNOUNCE_S,
        metavar="SECONDS",
        help=f"with --handover-s, stop after this long if the controller has announced no replacement "
        f"(default {ANNOUNCE_S:g}; EC2's provider passes its poll interval plus a heartbeat's)",
    )
    p.add_argument(
        "--sigterm-window-s",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="a SIGTERM comes this long before a SIGKILL (the local spot simulator's notice): with "
        "--handover-s, train through the first half of it",
    )
    p.add_argument(
        "--mtbf-s",
        type=float,
        help="with checkpoint.every: auto, the seconds between reclaims to plan for (the controller's "
        "estimate from the job's history; default the spec's mtbf_prior_s)",
    )
    p.add_argument("--inject-fault", metavar="KIND@STEP", help="sigkill|sigterm|crash|hang after step STEP")
    p.add_argument(
        "--worker-id",
        help="write a heartbeat to <storage>/_workers/ID/heartbeat.json (default $SPOTRUN_WORKER_ID)",
    )
    p.add_argument(
        "--lease-ttl",
        type=float,
        default=DEFAULT_TTL_S,
        help=f"seconds the storage lease lasts unrenewed, renewed every third (default {DEFAULT_TTL_S:g})",
    )
    p.add_argument(
        "--lease-takeover",
        action="append",
        default=[],
        metavar="WORKER_ID",
        help="a worker the controller has released: take its storage lease at once (repeatable)",
    )
    return p.parse_args(argv)


@dataclass(frozen=True)
class Environ:
    """What this process takes from its environment, read once here and passed down."""

    home: Path
    worker_id: str | None  # --worker-id, else SPOTRUN_WORKER_ID
    flow_run_id: str | None  # SPOTRUN_FLOW_RUN_ID: named in the storage lease
    metadata_endpoint: str | None  # SPOTRUN_IMDS_ENDPOINT: the notice watcher's base URL
    ranks: dict[str, str] | None = None  # torchrun's RANK, WORLD_SIZE, ...: this process is a rank
    rank_exits: str | None = None  # where a rank leaves its exit code for the launcher
    launcher_id: str | None = None  # the worker's identity, which rank 0's lease names

    @classmethod
    def read(cls, args: argparse.Namespace) -> Environ:
        env = os.environ
        rank = under_torchrun(env)
        return cls(
            home=spotrun_home(env),
            worker_id=None if rank else (args.worker_id or env.get("SPOTRUN_WORKER_ID") or None),
            flow_run_id=env.get("SPOTRUN_FLOW_RUN_ID") or None,
            metadata_endpoint=env.get("SPOTRUN_IMDS_ENDPOINT") or None,
            ranks=rank_env() if rank else None,
            rank_exits=env.get(RANK_EXITS) if rank else None,
            launcher_id=env.get(LAUNCHER_ID) if rank else None,
        )

    @property
    def rank(self) -> int:
        return int(self.ranks["RANK"]) if self.ranks else 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    env = Environ.read(args)  # the process edge: nothing below reads os.environ
    private_home(env.home)  # 0700 home, 0600 files (a store elsewhere keeps its own mode)
    if env.ranks is not None:
        die_with_agent()
    who = f"rank {env.rank} " if env.ranks is not None else ""
    logging.basicConfig(  # a forked rank replaces the handler it inherited from its worker
        level=logging.INFO,
        format=f"%(asctime)s %(levelname)s {who}%(name)s: %(message)s",
        stream=sys.stderr,
        force=env.ranks is not None,
    )
    stop = StopRequest()
    install_signal_handlers(stop)
    # ranks: only rank 0 speaks (the launcher relays it), and the launcher writes the exit record
    try:  # a rank writes to its stdout, which the launcher reads and relays to --status
        stream = open_status(args.status if env.ranks is None else "-") if env.rank == 0 else None
    except ConfigError as e:
        log.error("%s", e)
        return int(ExitCode.CONFIG_ERROR)
    reporter = StatusReporter(stream)
    error = ""
    with contextlib.ExitStack() as cleanup:  # the heartbeat outlives _run: it stores the exit record
        try:
            code, error = _run(args, argv, env, stop=stop, reporter=reporter, cleanup=cleanup)
        except Exception as e:  # the process boundary: every error becomes an exit code and one status line
            code, error = _classify(e), f"{type(e).__name__}: {e}"[:500]
        if env.rank_exits is not None:
            last = RankExit(
                env.rank, code, error, step=reporter.last_step, durable_step=reporter.last_durable
            )
            write_rank_exit(env.rank_exits, last)
            return int(code)
        reporter.emit(
            "exit",
            code=int(code),
            name=code.name,
            error=error,
            step=reporter.last_step,
            durable_step=reporter.last_durable,
        )
    return int(code)


def _classify(e: Exception) -> ExitCode:
    """Log the error the way its kind deserves and pick the exit code."""
    code, shown = _exit_code(e)
    if is_echo(e):  # rank 0's verdict, raised on every rank: rank 0 has said it
        log.info("stopping with rank 0 (%s; rank 0 logged why)", type(e).__name__)
    elif shown is not None:
        if not shown.logged:
            log.error("%s", shown)
    elif isinstance(transient := e.__cause__ if isinstance(e, CheckpointError) else e, TransientStorageError):
        # the network or the endpoint, not our code: one line, no traceback (botocore already retried)
        log.error(
            "storage unreachable: %s; exiting to be retried from the last durable checkpoint", transient
        )
    elif isinstance(e, CheckpointError | StorageError):
        log.exception("storage failure; the last durable checkpoint is intact")
    else:
        log.exception("training crashed")
    return code


def _exit_code(e: Exception) -> tuple[ExitCode, SpotrunError | None]:
    """The exit code for `e`, and the error to log as one line (None: log it with its traceback)."""
    if isinstance(e, ConfigError | ResumeIncompatible):
        return ExitCode.CONFIG_ERROR, e
    if isinstance(e, TrainingDiverged):
        return ExitCode.DIVERGED, e
    if isinstance(e, LeaseHeld):
        return ExitCode.LEASE_HELD, e
    lost = e if isinstance(e, LeaseLost) else e.__cause__
    if isinstance(lost, LeaseLost):
        # taken over: another writer is live; merely expired (storage unreachable): a retry re-acquires
        return (ExitCode.LEASE_LOST if lost.taken_by is not None else ExitCode.CRASHED), lost
    cause = e.__cause__ if isinstance(e, CheckpointError) else e
    if isinstance(cause, StorageError) and not isinstance(cause, TransientStorageError):
        return ExitCode.CONFIG_ERROR, cause
    return ExitCode.CRASHED, None


def job_storage(spec: JobSpec, override: str | None, home: Path) -> JobSpec:
    """The spec with its storage (or `--storage`, validated like the job file's own field) made absolute:
    a relative one under SPOTRUN_HOME, as `spotrun run` resolves it, never under the current directory."""
    if override:
        spec = parse_spec({**spec.model_dump(mode="json"), "storage": override}, "--storage")
    return spec.model_copy(update={"storage": resolve_uri(spec.storage, home)})


def _run(
    args: argparse.Namespace,
    argv: list[str],
    env: Environ,
    *,
    stop: StopRequest,
    reporter: StatusReporter,
    cleanup: contextlib.ExitStack,
) -> tuple[ExitCode, str]:
    spec = job_storage(load_spec(args.config), args.storage, env.home)
    if spec.run_key is not None and not spec.resolved:  # its key, data and storage are filled per run
        how = "run the job with `spotrun run` (--run-key for a given key) or its deployment"
        raise ConfigError(
            f"{args.config}: run_key {spec.run_key!r} is filled per run by the controller; {how}"
        )
    uri = spec.storage
    if args.allow_changes:
        spec = spec.model_copy(update={"resume": spec.resume.model_copy(update={"allow_changes": True})})
    # a bad --resume-from or --inject-fault: one line here, before any storage or rank starts
    resume_from = _resume_source(args.resume_from, spec)
    fault = Fault.parse(args.inject_fault) if args.inject_fault else None
    skips = tuple(_skip(v) for v in args.skip_steps)
    storage = spec.open_storage(uri)
    heartbeat = HeartbeatWriter(storage, env.worker_id) if env.worker_id is not None else None
    if heartbeat is not None:
        reporter.subscribe(heartbeat)
        cleanup.callback(heartbeat.close)
    seen = StopSeen()
    reporter.subscribe(seen)
    launched = None
    try:
        if spec.distributed is not None and env.ranks is None:  # the worker's command: start the ranks
            # before the heartbeat's thread: torchrun forks from here on CPU (trainer/launch/start.py)
            launcher_id = env.worker_id or f"local-{os.getpid()}"  # what the local provider calls it
            on_cpu = _device(spec).type == "cpu"
            out = reporter.stream  # --status fd:N or FILE: the supervisor's alone, not the ranks'
            status_fd = None if out is None or out is sys.stdout else out.fileno()
            launched = start_ranks(
                spec.distributed,
                argv,
                spec.threads,
                launcher_id=launcher_id,
                stop=stop,
                fork=on_cpu,
                private=status_fd,
            )
    finally:  # started even when the ranks could not be: the exit record must reach the storage
        if heartbeat is not None:
            heartbeat.start()

    def on_notice(n: Notice) -> None:
        reporter.emit("notice", **n.record())

    if launched is not None:
        code, error = relay(launched, reporter)
        _hooks(spec, code, stop=stop, seen=seen, reporter=reporter, sigterm_window_s=args.sigterm_window_s)
        return code, error
    ranks = Ranks.solo()
    if env.ranks is not None:
        assert spec.distributed is not None
        ranks = Ranks.start(spec.distributed, env.ranks, _device(spec).type)
    # after install_signal_handlers (main): a notice and a SIGTERM meet in the same StopRequest; with
    # ranks, one watcher per machine (its first rank) and the stop reaches the rest by agreement
    local_rank = int(env.ranks.get("LOCAL_RANK", "0")) if env.ranks else 0
    watcher = (
        make_watcher(spec.preemption, stop, on_notice, env.metadata_endpoint) if local_rank == 0 else None
    )
    if watcher is not None:
        watcher.start()
    me = Holder.this_process(env.launcher_id or env.worker_id, env.flow_run_id)
    # ranks agree on their stop every step: no handover there (trainer/preemption/handover.py)
    solo = env.ranks is None
    try:
        # rank 0 holds the job's lease and alone publishes (manifest, `latest`, COMPLETED.json): taken after
        # the recipe is built, before anything is published; released before the exit record, so the next
        # attempt finds it free
        with contextlib.ExitStack() as lease_scope:
            lease = functools.partial(
                held,
                storage,
                me,
                args.lease_ttl,
                released=args.lease_takeover,
                wait_s=max(args.prewarm_wait, 0.0),
            )

            def claim(peer: Advert | None) -> Storage:
                return lease_scope.enter_context(lease(peer=peer))

            opts = AttemptOptions(
                cache=Path(args.cache) if args.cache else env.home / "cache" / local_dir_name(spec.name, uri),
                max_steps=args.max_steps,
                metrics_path=Path(args.metrics) if args.metrics and env.rank == 0 else None,
                ranks=ranks,
                stop=stop,
                resume_from=resume_from,
                fault=fault,
                skip_steps=skips,
                mtbf_s=args.mtbf_s if args.mtbf_s and args.mtbf_s > 0 else None,
                claim=claim if env.rank == 0 else None,
                prewarmed=args.prewarm_wait > 0,
                handover_s=max(args.handover_s, 0.0) if solo else 0.0,
                worker_id=me.worker_id if solo else None,
                sigterm_window_s=max(args.sigterm_window_s, 0.0) if solo else 0.0,
                announce_s=max(args.announce_s, 0.0) if solo else ANNOUNCE_S,
                reporter=reporter,
            )
            attempt = run_command if spec.command is not None else run_attempt
            result = attempt(spec, storage, opts)
        ranks.close()
    finally:
        if watcher is not None:
            watcher.close()
    start = "from scratch" if result.resumed_from is None else f"resumed from step {result.resumed_from}"
    durable = "none durable" if result.durable_step is None else f"durable {result.durable_step}"
    log.info("attempt finished: %s at step %d (%s, %s)", result.code.name, result.step, start, durable)
    if solo:  # a launcher's or a single process's: a rank runs none
        _hooks(
            spec, result.code, stop=stop, seen=seen, reporter=reporter, sigterm_window_s=args.sigterm_window_s
        )
    return result.code, ""


def _hooks(
    spec: JobSpec,
    code: ExitCode,
    *,
    stop: StopRequest,
    seen: StopSeen,
    reporter: StatusReporter,
    sigterm_window_s: float,
) -> None:
    """The job's hook for this ending (trainer/hooks/worker.py), after the last checkpoint is durable and
    the lease given back, before the exit record."""
    if spec.hooks is not None:
        ending = ending_of(code, stop, seen, reporter=reporter, sigterm_window_s=sigterm_window_s)
        run_worker_hook(spec, ending, environ=os.environ, reporter=reporter)


def _resume_source(value: str | None, spec: JobSpec) -> ResumeSource | None:
    """STEP, or a checkpoint directory URI (`s3://b/job/step_000001200`, a path) whose parent is opened."""
    if value is None:
        return None
    if value.isdigit():
        return ResumeSource(int(value))
    parent, _, name = value.rstrip("/").rpartition("/")
    step = parse_step_dir(name)
    if step is None or not parent:
        raise ConfigError(
            f"--resume-from {value!r}: give a step number or a .../step_NNNNNNNNN directory URI"
        )
    return ResumeSource(step, spec.open_storage(parent))


def _skip(value: str) -> tuple[int, int]:
    """`--skip-steps N@STEP` as (STEP, N)."""
    n, _, step = value.partition("@")
    if not (n.isdigit() and step.isdigit()):
        raise ConfigError(
            f"--skip-steps {value!r}: give N@STEP, such as 6@100 (the data of 6 steps after step 100)"
        )
    return int(step), int(n)


def _exit_now(code: int) -> None:
    """Leave without interpreter teardown: the checkpoint is durable and the exit line written, and a
    teardown costs ~1 s (measured) that a preempted machine may not have, during which a late SIGTERM
    would turn a clean exit into -15."""
    sys.stdout.flush()
    sys.stderr.flush()
    logging.shutdown()
    os._exit(code)


if __name__ == "__main__":
    _exit_now(main())
