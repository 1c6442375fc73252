"""Structured progress lines for whoever supervises the trainer (the flow's provider).

Each line is `@spotrun {json}`, flushed at once, on the stream `--status` names: stdout by default, or
a descriptor or file of its own (the local provider passes a pipe, so that the records never mix with
what a recipe prints and the log on stderr stays for people). Kinds:
  started   {resumed_from, checkpoint, step, total_steps,      training is about to take its first step,
             rejected: [{step, reason}]}                       from the checkpoint the trainer chose (URI,
                                                               or null: scratch) past the ones it refused,
                                                               newest first: the one authority on resume
            + {resharded_from, changes: [{field, old, new}]}   after a resharded resume, or one that
                                                               changed training settings (allow_changes)
            + {warm_start: {job, run_key, step, parts,         a job with init_from: the run it started
               loaded, reason}}                                from and whether it loaded it (every
                                                               attempt; a resumed one from its checkpoint)
  step      {step, loss, steps_per_s, durable_step[, standby_step]}  at most 4 a second, and at log_every
  saving    {step}                                             a checkpoint of that step has begun
  section   {name, begin, step}                                an evaluation (or other non-step stretch)
                                                               began or ended
  durable   {step}                                             a checkpoint was read back and verified
  notice    {cloud, action, stop, deadline}                    a cloud notice (a rebalance: stop false)
  stopping  {reason, step}                                     a stop request (SIGTERM, notice) arrived
            + {save, save_reason, deadline}                    when it carried a deadline: emergency
                                                               checkpoint taken or skipped, and why
  interval  {seconds, cost_s, mtbf_s, measured, reason}        `checkpoint.every: auto` chose an interval
  hook      {event, command, code, timed_out, duration_s,      a hook of the job ran (trainer/hooks/):
             timeout_s, output, error}                         its exit code, or killed at its timeout
  exit      {code, name, error, step, durable_step}            the attempt is over
A supervisor treats the time since the last line as the heartbeat: a hung trainer stops writing.
Each record is a typed dataclass (trainer/telemetry/records.py) on both sides; the line is its JSON form.
Listeners (`subscribe`) get every record, also without a stream: the storage heartbeat
(trainer/telemetry/heartbeat.py) for supervisors that cannot read stdout.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import IO, Any

from spotrun.trainer.errors import ConfigError
from spotrun.trainer.telemetry.records import Durable, Record, Step, build, parse_record

log = logging.getLogger(__name__)

PREFIX = "@spotrun "


class StatusReporter:
    """Writes status lines; thread-safe (the checkpoint thread reports durability)."""

    def __init__(self, stream: IO[str] | None = None, min_interval_s: float = 0.25) -> None:
        self.stream = stream
        self.min_interval_s = min_interval_s
        self._last_step_line = 0.0
        self._lock = threading.Lock()
        self.last_step: int | None = None  # newest step seen, reported or not: the exit line carries it
        self.last_durable: int | None = None
        self._listeners: list[Callable[[Record], None]] = []

    def subscribe(self, listener: Callable[[Record], None]) -> None:
        """Call `listener(record)` after each record is written; it runs in the emitting thread and
        must not raise."""
        self._listeners.append(listener)

    def emit(self, kind: str, **fields: Any) -> None:
        """Report a record of `kind` with these fields, stamped now
        (trainer/telemetry/records.py lists them)."""
        self.report(build(kind, time.time(), **fields))

    def report(self, rec: Record) -> None:
        """Write one record and hand it to the listeners."""
        if isinstance(rec, Durable):
            self.last_durable = rec.step
        elif isinstance(rec, Step):  # relayed from a rank (trainer/launch/start.py), or our own
            self.last_step = rec.step
        if self.stream is not None:
            line = PREFIX + json.dumps(rec.to_json(), separators=(",", ":"))
            with self._lock:
                self.stream.write(line + "\n")
                self.stream.flush()
        for listener in self._listeners:
            listener(rec)

    def step(
        self,
        step: int,
        loss: float,
        steps_per_s: float,
        durable_step: int | None,
        force: bool,
        standby_step: int | None = None,
    ) -> None:
        self.last_step = step
        now = time.monotonic()
        if not force and now - self._last_step_line < self.min_interval_s:
            return
        self._last_step_line = now
        rate = round(steps_per_s, 3)
        more = {"standby_step": standby_step} if standby_step is not None else {}
        self.emit("step", step=step, loss=loss, steps_per_s=rate, durable_step=durable_step, **more)


def stdout_reporter() -> StatusReporter:
    return StatusReporter(sys.stdout)


def open_status(dest: str) -> IO[str]:
    """The stream `--status DEST` names: `-` stdout, `fd:N` a descriptor the supervisor passed (so the
    records travel apart from whatever the recipe prints), else a file opened for appending. A
    descriptor that is not open falls back to stdout, with a warning: a wrapper between the supervisor
    and the trainer may have closed it, and the records must reach someone."""
    if dest == "-":
        return sys.stdout
    if dest.startswith("fd:"):
        try:
            return os.fdopen(int(dest[3:]), "w", buffering=1, encoding="utf-8")
        except (ValueError, OSError) as e:
            log.warning("--status %s: cannot open (%s); writing status records to stdout", dest, e)
            return sys.stdout
    try:
        return open(dest, "a", buffering=1, encoding="utf-8")
    except OSError as e:
        raise ConfigError(
            f"--status {dest}: cannot open for appending ({e.strerror}); give a writable path"
        ) from None


def parse_status_line(line: str) -> Record | None:
    """The status record in a stdout line, or None for ordinary output (and for a record this version
    does not know or cannot read: the caller keeps such a line as log)."""
    if not line.startswith(PREFIX):
        return None
    try:
        obj = json.loads(line[len(PREFIX) :])
    except json.JSONDecodeError:
        return None
    return parse_record(obj)
