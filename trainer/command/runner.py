"""One attempt of a `command:` job: an unchanged script, run by the trainer.

Before the start the newest valid checkpoint is restored into `{checkpoint_dir}` (trainer/command/
publish.py); the script is started with the placeholders filled and spotrun's variables in its environment
(trainer/command/link.py); while it runs, every complete checkpoint it writes is published with a
manifest (trainer/command/layouts.py says which are complete) and the steps it reports become status
records and per-step metrics; a notice is forwarded as the notice file, then the stop signal; its exit is
classified. The trainer holds the storage lease for the whole attempt, so it alone publishes.

What a notice saves depends on the script: one that polls the notice file or catches the stop signal
(the integrations' callbacks do) saves at its next step and loses none; an unchanged script that the
signal kills loses the steps since its last checkpoint.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from spotrun.trainer.checkpoint.completion import completed_for, mark_completed
from spotrun.trainer.checkpoint.signing import KEY_ENV, OLD_KEYS_ENV
from spotrun.trainer.command.layouts import Found, Seen, find
from spotrun.trainer.command.link import (
    CHECKPOINT_DIR,
    NOTICE_FILE,
    RESUME_STEP,
    STEPS_FILE,
    STOP_SIGNAL,
    TOTAL_STEPS,
    read_steps,
    write_notice,
)
from spotrun.trainer.command.publish import publish, restore
from spotrun.trainer.errors import ConfigError
from spotrun.trainer.exitcodes import ExitCode
from spotrun.trainer.parent_death import arm_pdeathsig
from spotrun.trainer.session.options import AttemptOptions, AttemptResult
from spotrun.trainer.spec.job import JobSpec
from spotrun.trainer.spec.templating import fill
from spotrun.trainer.storage import Storage
from spotrun.trainer.telemetry.metrics_log import MetricsLog, prune_after

log = logging.getLogger(__name__)

POLL_S = 0.25  # how often the directory and the steps file are looked at
# A script's own exit codes that keep their meaning; any other failure is a crash (retried).
KEPT = {int(c): c for c in (ExitCode.CONFIG_ERROR, ExitCode.DIVERGED, ExitCode.PREEMPTED)}


@dataclass
class _Follower:
    """What the attempt sees of the running script: the steps it reports (status records, per-step
    metrics, the `--metrics` file) and the checkpoints it writes (published in step order)."""

    spec: JobSpec
    storage: Storage
    opts: AttemptOptions
    ckpt_dir: Path
    steps_file: Path
    step: int  # the newest step the script reported
    durable: int | None  # the newest checkpoint published
    started: Callable[[], None] | None = None  # the `started` record, sent once the script trains
    losses: TextIO | None = None  # every step's loss, as a recipe's trainer writes them (`--metrics`)
    offset: int = 0
    seen: Seen = field(default_factory=dict)
    failed: set[int] = field(default_factory=set)  # steps whose publishing failed (gone mid-copy)

    def __post_init__(self) -> None:
        self.metrics = MetricsLog(self.storage)

    def begin(self) -> None:
        """Training has begun (the script reported a step or wrote a checkpoint): say so once. What came
        before, the restore and the script's own start (imports, model build), is restart cost."""
        if self.started is not None:
            self.started()
            self.started = None

    def look(self, *, settled: bool = False) -> None:
        """Read the steps the script reported since the last look, then publish its new checkpoints
        (`settled`: the script has exited, so a file that is there is whole)."""
        lines, self.offset = read_steps(self.steps_file, self.offset)
        if lines:
            self.begin()
        for line in lines:
            self._step(line)
        for found in find(self.ckpt_dir, None if settled else self.seen):
            if (self.durable is not None and found.step <= self.durable) or found.step in self.failed:
                continue  # the restored checkpoint (or an older one) is no sign that the script trained
            self.begin()  # a script that reports no steps has trained once it wrote a checkpoint
            self._publish(found)

    def _step(self, line: dict[str, Any]) -> None:
        step = int(line["step"])
        if "section" in line:  # an evaluation began or ended: no step
            name, begin = str(line["section"])[:64], line.get("begin") is True
            self.opts.reporter.emit("section", name=name, begin=begin, step=step)
            return
        loss = _float(line.get("loss"))
        if loss is not None:
            extra = {k: v for k, h in (line.get("m") or {}).items() if (v := _float(h)) is not None}
            # the rate the scheduler set next is the script's secret: the fidelity check compares no rate
            self.metrics.record(step, loss, lr=_float(line.get("lr")), lr_next=None, metrics=extra)
            if line.get("compare") is False:  # for MLflow only: no other attempt computed this value
                loss = None
            elif self.losses is not None:
                self.losses.write(json.dumps({"step": step, "loss": loss.hex()}) + "\n")
                self.losses.flush()
        if step > self.step:
            self.step = step
            self.opts.reporter.emit("step", step=step, loss=loss, durable_step=self.durable)

    def _publish(self, found: Found) -> None:
        try:
            publish(
                found,
                root=self.ckpt_dir,
                storage=self.storage,
                cache=self.opts.cache,
                spec=self.spec,
                sidecars=self.metrics.sidecars(found.step),
            )
        except FileNotFoundError as e:  # the script rotated it away while it was copied: the next counts
            self.failed.add(found.step)
            log.warning("checkpoint step %d went away while it was published (%s); skipped", found.step, e)
            return
        self.durable = found.step
        self.metrics.written(found.step)
        self.opts.reporter.emit("durable", step=found.step)


# What the trainer holds and the script must not: the manifest keys sign what the trainer publishes of the
# script's checkpoints; a script (its dependencies, a `trust_remote_code` model) holding them could sign too.
WITHHELD = (KEY_ENV, OLD_KEYS_ENV)


def script_environ(environ: Mapping[str, str]) -> dict[str, str]:
    """The trainer's environment as the script gets it: everything but WITHHELD."""
    return {k: v for k, v in environ.items() if k not in WITHHELD}


def run_command(spec: JobSpec, storage: Storage, opts: AttemptOptions) -> AttemptResult:
    """Restore, run the script, publish what it writes, forward a notice, classify its exit."""
    assert spec.command is not None
    if spec.distributed is not None:
        raise ConfigError("command: with distributed: is not supported yet; run one process per job")
    done = completed_for(storage, spec)  # ConfigError: the storage holds another job, finished
    if done is not None:
        return AttemptResult(
            ExitCode.COMPLETED, done, resumed_from=done, durable_step=done, message="already completed"
        )
    if opts.claim is not None:
        storage = opts.claim(None)  # publish only through the storage this trainer holds
    work = opts.cache / "command"
    ckpt_dir = work / "checkpoints"
    work.mkdir(parents=True, exist_ok=True)
    selection = restore(storage, cache=opts.cache / "restore", into=ckpt_dir)
    start = selection.step or 0
    prune_after(storage, start)
    started = functools.partial(
        opts.reporter.emit,
        "started",
        resumed_from=selection.step,
        checkpoint=selection.uri,
        rejected=selection.rejected_records(),
        step=start,
        total_steps=spec.total_steps,
    )
    log.info("%s", selection.describe(storage.uri))
    notice_file, steps_file = work / "notice.json", work / "steps.jsonl"
    for stale in (notice_file, steps_file):
        stale.unlink(missing_ok=True)
    values = {
        **spec.run_values,
        "checkpoint_dir": str(ckpt_dir),
        "step": str(start),
        "world_size": "1",
        "total_steps": str(spec.total_steps),
        "python": sys.executable,
    }
    argv = [fill(a, values, f"command[{i}]") for i, a in enumerate(spec.command)]
    env = {
        **script_environ(os.environ),
        CHECKPOINT_DIR: str(ckpt_dir),
        RESUME_STEP: "" if selection.step is None else str(selection.step),
        TOTAL_STEPS: str(spec.total_steps),
        NOTICE_FILE: str(notice_file),
        STEPS_FILE: str(steps_file),
        STOP_SIGNAL: spec.stop_signal,
    }
    try:  # its own session: the stop signal reaches it from here, once the notice file is written
        child = subprocess.Popen(argv, env=env, start_new_session=True, preexec_fn=arm_pdeathsig)
    except OSError as e:
        raise ConfigError(
            f"command: cannot start {argv[0]!r} ({e.strerror}); fix the job file's command"
        ) from None
    log.info("command started, pid %d: %s", child.pid, " ".join(argv))
    progress = _Follower(
        spec=spec,
        storage=storage,
        opts=opts,
        ckpt_dir=ckpt_dir,
        steps_file=steps_file,
        step=start,
        durable=selection.step,
        started=started,
        losses=open(opts.metrics_path, "a") if opts.metrics_path else None,  # noqa: SIM115 (closed below)
    )
    forwarded = False
    stop_signal = signal.Signals[spec.stop_signal]
    try:
        while True:
            rc = child.poll()
            progress.look(settled=rc is not None)
            if rc is not None:
                break
            if opts.stop.requested and not forwarded:
                forwarded = True
                write_notice(notice_file, opts.stop.reason or "stop", opts.stop.deadline)
                opts.reporter.emit("stopping", reason=opts.stop.reason or "stop", step=progress.step)
                log.info("stop request (%s): %s to the command", opts.stop.reason, stop_signal.name)
                child.send_signal(stop_signal)
            time.sleep(POLL_S)
    except BaseException:
        child.kill()
        child.wait()
        raise
    finally:
        if progress.losses is not None:
            progress.losses.close()
    progress.begin()  # a script that ended before reporting anything still had its attempt
    finished = progress.durable is not None and progress.durable >= spec.total_steps
    code = _classify(rc, forwarded, finished=finished)
    log.info("command exited %d: %s", rc, code.name)
    if code is ExitCode.COMPLETED:
        final = max(progress.step, progress.durable or 0)
        mark_completed(storage, spec, final)
        shutil.rmtree(work, ignore_errors=True)
        return AttemptResult(
            code, final, resumed_from=selection.step, durable_step=progress.durable, message="completed"
        )
    return AttemptResult(
        code,
        progress.step,
        resumed_from=selection.step,
        durable_step=progress.durable,
        message=f"command exited {rc}",
    )


def _float(value: object) -> float | None:
    if isinstance(value, str):
        try:
            return float.fromhex(value)
        except ValueError:
            return None
    return float(value) if isinstance(value, int | float) else None


def _classify(rc: int, stopped: bool, *, finished: bool = False) -> ExitCode:
    """The attempt's exit code from the script's: 0 is completion unless a stop was forwarded (then it
    stopped early, and a resume finds out whether anything is left); 75 and a death by the forwarded
    signal are a preemption; 2 (argparse's usage error) and 3 keep their meaning; the rest is a crash.
    `finished`: the job's last step is durable, so a stop that came while the script trained through a
    notice to its end (0 or 75) is a completion: a resume from the last step would train on past it (a
    Transformers script resumed at max_steps takes one more step)."""
    code = _script_exit(rc, stopped)
    if finished and stopped and code is ExitCode.PREEMPTED:
        return ExitCode.COMPLETED
    return code


def _script_exit(rc: int, stopped: bool) -> ExitCode:
    if rc == 0:
        return ExitCode.PREEMPTED if stopped else ExitCode.COMPLETED
    if stopped and rc < 0:
        return ExitCode.PREEMPTED
    return KEPT.get(rc, ExitCode.CRASHED)
