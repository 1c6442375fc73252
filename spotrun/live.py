"""The live view of `spotrun run`: a job run followed through its metrics file and the SQL history."""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from spotrun.console import one_line

if TYPE_CHECKING:  # imported where used: `spotrun --help` must not load SQLAlchemy
    from spotrun.tasks.history import AttemptRow, HistoryStore, JobRunRow

log = logging.getLogger(__name__)

POLL_S = 0.5  # how often the live view reads the metrics file and the SQL history
TRAINING_GAP_S = 2.0  # no step for this long: the worker is starting, restoring or gone


class RunMonitor:
    """Follows one job run from outside the flow, through two outputs that are contracts, not log text:
    the trainer's --metrics file (one JSON line per step, appended by every attempt of the job; the
    local provider writes it to <workdir>/<job>-<storage hash>/metrics.jsonl) for the step and loss,
    and the SQL history for the job run (its flow run id) and each attempt once the flow recorded it."""

    def __init__(
        self, store: HistoryStore, job: str, metrics: Path, *, since: float, run_key: str | None = None
    ) -> None:
        self.store, self.job, self.metrics, self.since = store, job, metrics, since
        self.run_key = run_key
        self.offset = metrics.stat().st_size if metrics.exists() else 0  # earlier runs' lines
        self.partial = b""
        self.step, self.loss, self.stepped_at = 0, float("nan"), 0.0
        self.job_run: JobRunRow | None = None
        self.attempts: list[AttemptRow] = []
        self.history_error = ""

    def poll(self) -> list[AttemptRow]:
        """Read what is new; returns the attempts recorded since the last poll."""
        from spotrun.tasks.history import StoreUnavailable

        self._read_metrics()
        try:
            return self._read_history()
        except StoreUnavailable as e:  # training goes on while the database is down (the flow buffers)
            self.history_error = one_line(e)
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
            else "starting a worker"
            if not self.attempts
            else "restarting: worker start-up and restore"
        )
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
        from spotrun.tasks.history.models import JobStatus

        if self.job_run is None:
            runs = [  # a job run adopted from a dead controller started before this command
                r
                for r in reversed(self.store.job_runs(self.job, limit=5, run_key=self.run_key))
                if r.started_at >= self.since - 1 or r.status is JobStatus.RUNNING
            ]
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
            log.warning("live view stopped: %s", one_line(e))
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
