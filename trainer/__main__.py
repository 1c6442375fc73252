"""`python -m trainer --config JOB.yaml`: run one training attempt. Exit codes: trainer/exitcodes.py."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

from trainer.ckpt_format import parse_step_dir
from trainer.errors import (
    CheckpointError,
    ConfigError,
    ResumeIncompatible,
    StorageError,
    TrainingDiverged,
    TransientStorageError,
)
from trainer.exitcodes import ExitCode
from trainer.faults import Fault
from trainer.loop import AttemptOptions, ResumeSource, run_attempt
from trainer.preemption import StopRequest, install_signal_handlers
from trainer.spec import JobSpec, load_spec, parse_spec
from trainer.status import StatusReporter, stdout_reporter
from trainer.storage import open_storage

log = logging.getLogger("trainer")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m trainer", description=__doc__)
    p.add_argument("--config", required=True, help="job spec YAML")
    p.add_argument("--storage", help="override the spec's storage URI")
    p.add_argument(
        "--max-steps", type=int, help="stop after this many steps in this attempt (with a checkpoint)"
    )
    p.add_argument("--resume-from", help="require resuming from this step (or a step_NNN directory URI)")
    p.add_argument("--cache", help="local checkpoint directory (default $SPOTRUN_HOME/cache/<job>)")
    p.add_argument("--metrics", help="append per-step losses as JSON lines to this file")
    p.add_argument("--inject-fault", metavar="KIND@STEP", help="sigkill|sigterm|crash|hang after step STEP")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr
    )
    args = parse_args(argv)
    stop = StopRequest()
    install_signal_handlers(stop)
    reporter = stdout_reporter()
    error = ""
    try:
        code = _run(args, stop, reporter)
    except Exception as e:  # the process boundary: every error becomes an exit code and one status line
        code, error = _classify(e), f"{type(e).__name__}: {e}"[:500]
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
    if isinstance(e, ConfigError | ResumeIncompatible):
        log.error("%s", e)
        return ExitCode.CONFIG_ERROR
    if isinstance(e, TrainingDiverged):
        log.error("%s", e)
        return ExitCode.DIVERGED
    cause = e.__cause__ if isinstance(e, CheckpointError) else e
    if isinstance(cause, StorageError) and not isinstance(cause, TransientStorageError):
        log.error("%s", cause)
        return ExitCode.CONFIG_ERROR
    if isinstance(e, CheckpointError | StorageError):
        log.exception("storage failure; the last durable checkpoint is intact")
    else:
        log.exception("training crashed")
    return ExitCode.CRASHED


def _run(args: argparse.Namespace, stop: StopRequest, reporter: StatusReporter) -> ExitCode:
    spec = load_spec(args.config)
    uri = args.storage or spec.storage
    if args.storage:  # validated like the job file's own field
        spec = parse_spec({**spec.model_dump(mode="json"), "storage": args.storage}, "--storage")
    # The process edge: environment read here and passed down, never deep inside.
    home = Path(os.environ.get("SPOTRUN_HOME", ".spotrun"))
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    opts = AttemptOptions(
        cache=Path(args.cache) if args.cache else home / "cache" / spec.name,
        max_steps=args.max_steps,
        metrics_path=Path(args.metrics) if args.metrics else None,
        rank=rank,
        world_size=world,
        stop=stop,
        resume_from=_resume_source(args.resume_from, spec),
        fault=Fault.parse(args.inject_fault) if args.inject_fault else None,
        reporter=reporter,
    )
    storage = open_storage(uri, spec.s3)
    result = run_attempt(spec, storage, opts)
    log.info(
        "attempt finished: %s at step %d (resumed from %s, durable %s)",
        result.code.name, result.step, result.resumed_from, result.durable_step,
    )  # fmt: skip
    return result.code


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
    return ResumeSource(step, open_storage(parent, spec.s3))


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
