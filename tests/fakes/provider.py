"""A provider with no processes: each attempt plays a script of trainer status records and an ending,
for control-loop tests that run in milliseconds and for the provider contract suite.

The fake trainer resumes where the previous attempt of the same job left its newest durable step,
takes a checkpoint every `checkpoint_every` steps, and on its last step ends as the script says:

    FakeProvider([FakeAttempt(until=30, ending=Ending.NOTICE), FakeAttempt()], checkpoint_every=10)
    attempt 1: started(0) step.. durable(10) durable(20) .. notice -> stopping(30) durable(30) exit 75
    attempt 2: started(resumed_from=30) .. durable(100) exit 0, COMPLETED.json written

Record times come from a clock that advances `step_s` per step from the attempt's start, so the same
script yields the same records. A callback that raises is handled as the local provider handles it:
the trainer is stopped gracefully (stopping, emergency checkpoint, exit PREEMPTED), `stopped_by` set,
and the error re-raised.
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING

from spotrun.tasks.market.prices import Prices
from spotrun.tasks.providers.base import (
    KillReason,
    LogCallback,
    Market,
    NoticeKind,
    ProvisionError,
    StatusCallback,
    StopCause,
    WatchResult,
    Worker,
    stop_cause,
)
from spotrun.trainer.checkpoint.completion import mark_completed
from spotrun.trainer.exitcodes import ExitCode
from spotrun.trainer.storage import open_storage
from spotrun.trainer.telemetry.records import Durable, Exit, Record, Started, Step, Stopping

if TYPE_CHECKING:
    from spotrun.trainer.spec.job import JobSpec

KILL = int(signal.SIGKILL)


class Ending(StrEnum):
    """How a scripted attempt ends once it has reached its last step."""

    EXIT = "exit"  # the trainer exits with `exit_code` (COMPLETED at total_steps)
    NOTICE = "notice"  # a spot notice: stopping, emergency checkpoint, exit PREEMPTED
    NO_NOTICE = "no-notice"  # reclaimed without notice: SIGKILL, no exit record
    LOST = "lost"  # the trainer goes silent; the provider kills it and reports it lost
    SIGNAL = "signal"  # killed by `signal` (SIGKILL: out of memory), no exit record


@dataclass(frozen=True)
class FakeAttempt:
    """The script of one attempt. `until`: the last step it reaches (None: the job's total_steps).
    `records`: play exactly these instead of simulating a trainer (the ending still applies)."""

    until: int | None = None
    ending: Ending = Ending.EXIT
    exit_code: ExitCode | None = None  # with EXIT: default COMPLETED at total_steps, else CRASHED
    error: str = ""  # the exit record's error text
    signal: int = KILL  # with SIGNAL
    records: tuple[Record, ...] | None = None
    provision_error: ProvisionError | None = None  # provision() raises this instead
    log: tuple[str, ...] = ()  # lines for on_log (and the log tail) before the ending


@dataclass
class _Handle:
    script: FakeAttempt
    job: JobSpec
    resume: int | None  # the durable step this attempt starts from
    released_at: float | None = None
    watching: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)


class FakeProvider:
    """Scripted attempts (entry i for attempt i+1; past the end, attempts complete). No processes."""

    def __init__(
        self,
        script: Sequence[FakeAttempt] = (),
        *,
        name: str = "fake",
        checkpoint_every: int = 10,
        step_s: float = 0.01,
        heartbeat_timeout_s: float = 60.0,
        write_marker: bool = True,
    ) -> None:
        self.name, self.script = name, list(script)
        self.prewarm = False  # scripted attempts: nothing to start ahead
        self.rebalance_wait_s: float | None = None
        self.capacity_poll_s = 0.0
        self.prices: Prices | None = None
        self.checkpoint_every, self.step_s, self.heartbeat_timeout_s = (
            checkpoint_every,
            step_s,
            heartbeat_timeout_s,
        )
        self.write_marker = write_marker  # a completed attempt writes COMPLETED.json to the job's storage
        self.durable: dict[str, int] = {}  # job name -> newest durable step any attempt reached
        self.provisioned: list[Worker] = []
        self.spot_refusals = 0  # the next this many spot launches are refused for capacity (retryable)
        self.released: list[str] = []  # worker ids, in release order (repeats included)

    def provision(
        self, job: JobSpec, attempt: int, spec_path: Path, extra_args: list[str], *, market: Market = "spot"
    ) -> Worker:
        """A worker for `attempt` that exists only in memory; the script's provision_error if it has one."""
        script = self.script[attempt - 1] if attempt <= len(self.script) else FakeAttempt()
        if script.provision_error is not None:
            raise script.provision_error
        if market == "spot" and self.spot_refusals > 0:
            self.spot_refusals -= 1
            raise ProvisionError("no spot capacity (scripted)", retryable=True)
        handle = _Handle(script, job, self.durable.get(job.name))
        worker = Worker(
            f"fake-{job.name}-{attempt}",
            self.name,
            attempt,
            started_at=time.time(),
            handle=handle,
            market=market,
        )
        self.provisioned.append(worker)
        return worker

    def watch(
        self, worker: Worker, on_status: StatusCallback | None = None, on_log: LogCallback | None = None
    ) -> WatchResult:
        """Play the attempt's records to `on_status`, then its ending; stops early once released."""
        h: _Handle = worker.handle
        result = worker.result = WatchResult(started_at=worker.started_at)
        clock = _Clock(worker.started_at)
        with h.lock:
            h.watching = h.released_at is None

        def emit(rec: Record, quiet: bool = False) -> None:
            self._fold(result, rec)
            if isinstance(rec, Durable):
                self.durable[h.job.name] = max(self.durable.get(h.job.name, 0), rec.step)
            if on_status is not None and not quiet:
                on_status(rec)

        try:
            if h.watching:
                for rec in self._records(h, clock):
                    if h.released_at is not None:
                        break
                    emit(rec)
                for line in h.script.log:
                    result.log_tail = "\n".join([*result.log_tail.splitlines(), line])
                    if on_log is not None:
                        on_log(line)
        except BaseException as e:  # a cancel, Ctrl-C or a callback's error: stop gracefully, as local does
            result.stopped_by = stop_cause(e)
            self._graceful_exit(result, clock, lambda rec: emit(rec, quiet=True))  # the flow is going away
            result.ended_at = clock.now()
            raise
        if h.released_at is not None:
            result.signal, result.killed_at, result.kill_reason = KILL, h.released_at, KillReason.RELEASE
        else:
            self._end(h, result, clock, emit)
        result.ended_at = clock.now()
        return result

    def stop(self, worker: Worker, cause: StopCause) -> WatchResult:
        """SIGTERM before the watch played anything: the trainer started, then its graceful exit."""
        h: _Handle = worker.handle
        result = worker.result = WatchResult(started_at=worker.started_at, stopped_by=cause)
        clock = _Clock(worker.started_at)
        start = h.resume or 0
        self._fold(
            result, Started(t=clock.now(), resumed_from=h.resume, step=start, total_steps=h.job.total_steps)
        )
        self._graceful_exit(result, clock, lambda rec: self._fold(result, rec))
        result.ended_at = clock.now()
        return result

    def stop_leftovers(self, flow_run_id: str) -> list[str]:
        return []  # scripted attempts leave no process behind

    def release(self, worker: Worker) -> None:
        """Mark the worker gone (a running watch stops at its next record). Idempotent."""
        h: _Handle = worker.handle
        with h.lock:
            if h.released_at is None:
                h.released_at = time.time()
        self.released.append(worker.id)

    def _records(self, h: _Handle, clock: _Clock) -> Iterator[Record]:
        if h.script.records is not None:
            yield from h.script.records
            return
        total, start = h.job.total_steps, h.resume or 0
        until = min(total, h.script.until if h.script.until is not None else total)
        yield Started(t=clock.now(), resumed_from=h.resume, step=start, total_steps=total)
        durable = h.resume
        for step in range(start + 1, until + 1):
            clock.tick(self.step_s)
            yield Step(
                t=clock.now(), step=step, loss=1.0 / step, steps_per_s=1 / self.step_s, durable_step=durable
            )
            if step % self.checkpoint_every == 0 or step == total:
                durable = step
                yield Durable(t=clock.now(), step=step)

    def _end(self, h: _Handle, r: WatchResult, clock: _Clock, emit: Callable[[Record], None]) -> None:
        s, step = h.script, r.last_step
        if s.ending is Ending.NOTICE:
            r.notice_kind, r.notice_at = NoticeKind.SIM_NOTICE, clock.now()
            self._graceful_exit(r, clock, emit)
        elif s.ending is Ending.NO_NOTICE:
            r.notice_kind, r.signal = NoticeKind.SIM_NO_NOTICE, KILL
            r.killed_at, r.kill_reason = clock.now(), KillReason.NO_NOTICE
        elif s.ending is Ending.LOST:
            clock.tick(self.heartbeat_timeout_s)
            r.lost, r.silent_s, r.signal = True, self.heartbeat_timeout_s, KILL
            r.killed_at, r.kill_reason = clock.now(), KillReason.LOST
        elif s.ending is Ending.SIGNAL:
            r.signal = s.signal
        else:
            done = r.started is not None and step >= h.job.total_steps
            code = (
                s.exit_code if s.exit_code is not None else ExitCode.COMPLETED if done else ExitCode.CRASHED
            )
            if code is ExitCode.COMPLETED and self.write_marker:
                mark_completed(open_storage(h.job.storage, h.job.s3), h.job, step)
            emit(
                Exit(
                    t=clock.now(),
                    code=int(code),
                    name=code.name,
                    error=s.error,
                    step=step,
                    durable_step=r.last_durable_step,
                )
            )
            r.exit_code = int(code)

    def _graceful_exit(self, r: WatchResult, clock: _Clock, emit: Callable[[Record], None]) -> None:
        """The trainer on SIGTERM: stopping, an emergency checkpoint at the current step, exit 75."""
        step = r.last_step
        clock.tick(self.step_s)
        emit(Stopping(t=clock.now(), reason="SIGTERM", step=step))
        if r.started is not None:
            emit(Durable(t=clock.now(), step=step))
        code = ExitCode.PREEMPTED
        emit(Exit(t=clock.now(), code=int(code), name=code.name, step=step, durable_step=r.last_durable_step))
        r.exit_code = int(code)

    @staticmethod
    def _fold(r: WatchResult, rec: Record) -> None:
        r.fold(rec)
        if isinstance(rec, Started):
            r.started_training_at = rec.t
            r.step_times.append((rec.t, rec.step))
        elif isinstance(rec, Step):
            r.step_times.append((rec.t, rec.step))
        elif isinstance(rec, Durable):
            r.durable_times.append((rec.t, rec.step))


class _Clock:
    """Deterministic record times: the attempt's start plus the simulated time so far."""

    def __init__(self, start: float) -> None:
        self.t = start

    def now(self) -> float:
        return self.t

    def tick(self, dt: float) -> None:
        self.t += dt
