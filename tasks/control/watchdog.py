"""The progress watchdog: a worker that stops making progress is killed and its attempt recorded `hung`.

It lives on the controller, beside the provider's watch, and not in the trainer as a thread, because
what hangs is usually what a thread in the same process cannot get out of: a collective waiting for a
rank that died, a read from a dead network file system (the process in D state), a C extension holding
the GIL. The controller sees the status records every trainer streams (`started`, `step`, `saving`,
`durable`: trainer/telemetry/records.py), whatever runs inside it (a recipe, a user's loop, a rank of
torchrun), and kills through the provider (`release`, the same kill a lost worker gets) what the
trainer could not kill itself. A thread here ticks every TICK_S: records only arrive while a worker
makes progress, and silence is what is timed.

What is timed, and against which limit (tasks/decisions/watchdog.py calibrates them):
  started -> first progress record             start-up
  progress record -> next one                  step (a `saving` record counts as progress)
  saving -> its durable                        save; the step clock waits meanwhile (a final or
                                               emergency save blocks the loop), and restarts at durable
A `stopping`, a stopping `notice` or an `exit` stands the watchdog down: the notice window is the
provider's to time. Before `started`, the provider's own start-up timeout applies.

Measured: a hung ~2 ms-step recipe (digits, `step_floor_s: 3` in its job file) was gone 3.05, 3.11 and
3.24 s after its last step record in three runs (the timeout plus at most one tick and the kill), against
the 60 s of the local provider's default heartbeat (tests/e2e/test_hung.py).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from spotrun.tasks.decisions.anomaly import LossSpikes, Throughput
from spotrun.tasks.decisions.attempts import AttemptRecord
from spotrun.tasks.decisions.watchdog import Limit, describe, history_figures, limits, measured
from spotrun.tasks.history import HistoryStore, StoreUnavailable
from spotrun.tasks.providers.base import (
    LogCallback,
    Provider,
    StatusCallback,
    StopCause,
    StopWorker,
    WatchResult,
    Worker,
    stopped,
)
from spotrun.trainer.exitcodes import ExitCode
from spotrun.trainer.spec.watchdog import WatchdogOptions
from spotrun.trainer.telemetry.records import (
    Durable,
    Exit,
    Notice,
    Record,
    Saving,
    Section,
    Started,
    Step,
    Stopping,
)

log = logging.getLogger(__name__)

TICK_S = 0.2  # how often the silence is compared with the limit: the kill comes at most this late
SAMPLES = 4096  # step and save times kept per attempt (the newest)
HISTORY_ROWS = 50  # the job's newest attempts read for calibration (only those with figures count)
KILL_JOIN_S = 40.0  # a kill in flight (release waits up to 30 s for a process in D state)


class ProgressWatchdog:
    """One attempt's watchdog: `observe` each record (the watch's thread), `guard` the watch (a ticking
    thread that kills on a timeout), then `finish` puts what it measured and did into the result."""

    def __init__(
        self,
        opts: WatchdogOptions,
        history: dict[str, list[float]],
        fallback_s: float,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.opts, self.history, self.fallback_s, self.clock = opts, history, fallback_s, clock
        self._lock = threading.Lock()
        self.phase = "waiting"  # waiting (for started) | startup | running | off
        self._armed_at = 0.0  # arrival of `started`, then of the newest progress (or a save's durable)
        self._last_t: float | None = None  # the newest step record's own time
        self._started_t = 0.0
        self._saving: tuple[int, float, float] | None = None  # (step, arrival, record t) in flight
        self._section: tuple[str, float] | None = None  # (name, arrival): an evaluation, untimed as a step
        self.last_step = 0
        self.starts: list[float] = []
        self.steps: deque[float] = deque(maxlen=SAMPLES)
        self.saves: deque[float] = deque(maxlen=SAMPLES)
        self._limits: dict[str, Limit] | None = None  # recomputed when a sample arrives
        self.fired: dict[str, Any] | None = None
        self._kill_due = False  # a rule fired on a record: the guard's next tick kills
        spike, rate = opts.loss_spike, opts.throughput
        self.spikes = LossSpikes(spike.factor, spike.window, spike.patience) if spike else None
        self.rate = Throughput(rate.factor, rate.window_s) if rate else None

    # ---- the records (the watch's thread) ----

    def observe(self, rec: Record) -> None:
        """Take one status record as it arrives."""
        now = self.clock()
        with self._lock:
            if isinstance(rec, Started):
                self.phase, self._armed_at, self._started_t = "startup", now, rec.t
            elif isinstance(rec, Step | Saving):
                self._progress(rec, now)
            elif isinstance(rec, Section):
                self._section = (rec.name, now) if rec.begin else None
                self._armed_at = max(self._armed_at, now)  # the step clock starts again at its end
                if self.rate is not None:
                    self.rate.reset()
            elif isinstance(rec, Durable):
                if self._saving is not None and rec.step >= self._saving[0]:
                    self.saves.append(max(0.0, rec.t - self._saving[2]))
                    self._saving, self._limits = None, None
                    self._armed_at = max(self._armed_at, now)
            elif isinstance(rec, Stopping | Exit) or (isinstance(rec, Notice) and rec.stop):
                self.phase = "off"

    def _progress(self, rec: Step | Saving, now: float) -> None:
        if self.phase == "off":
            return
        self.last_step = max(self.last_step, rec.step)
        if self.phase == "startup":
            self.starts.append(max(0.0, rec.t - self._started_t))
            self.phase = "running"
        elif isinstance(rec, Step) and self._last_t is not None:
            self.steps.append(max(0.0, rec.t - self._last_t))
            self._limits = None
        if isinstance(rec, Step):
            self._last_t = rec.t
            self._rules(rec)
        else:
            self._saving = (rec.step, now, rec.t)
        self._armed_at = now

    def _rules(self, rec: Step) -> None:
        """The loss-spike and throughput rules on one step record (the lock is held). A spike is killed
        by the guard's next tick (the state is suspect: no emergency checkpoint of it); a collapse stops
        the worker from this thread (`StopWorker`: its emergency checkpoint first, the host is suspect)."""
        if self.fired is not None or self.phase != "running" or self._section is not None:
            return
        if self.spikes is not None and rec.loss is not None:
            spike = self.spikes.observe(rec.step, rec.loss)
            if spike is not None:
                self._rule_fired("loss_spike", spike.describe(), spike.as_dict())
                self._kill_due = True
                return
        if self.rate is not None:
            collapse = self.rate.observe(rec.t, rec.step)
            if collapse is not None:
                self._rule_fired("throughput", collapse.describe(), collapse.as_dict())
                raise StopWorker(StopCause.WATCHDOG, collapse.describe())

    def _rule_fired(self, section: str, detail: str, facts: dict[str, Any]) -> None:
        self.fired = {
            "section": section,
            "detail": detail,
            "step": self.last_step,
            "fired_at": time.time(),
            **facts,
        }

    # ---- the clock (the guard's thread) ----

    def limits(self) -> dict[str, Limit]:
        """The three timeouts as they stand (recalibrated when a sample arrived)."""
        if self._limits is None:
            own: dict[str, Sequence[float]] = {"step": list(self.steps), "save": list(self.saves)}
            self._limits = limits(self.opts, own, self.history, self.fallback_s)
        return self._limits

    def check(self, now: float) -> dict[str, Any] | None:
        """The firing (what timed out, after how long) if the silence now exceeds its limit, else None."""
        with self._lock:
            if self._kill_due:  # a rule fired on a record: kill now
                self._kill_due = False
                return self.fired
            if not self.opts.enabled or self.fired is not None or self.phase in ("waiting", "off"):
                return None
            if self._section is not None:  # a long evaluation is no hang: timed only if the job says so
                if self.opts.section_s is None:
                    return None
                lim, since = Limit(self.opts.section_s, "job file"), self._section[1]
                if now - since < lim.seconds:
                    return None
                return self._fire("section", lim, now - since)
            if self._saving is not None:
                section, since = "save", self._saving[1]
            else:
                section, since = ("startup" if self.phase == "startup" else "step"), self._armed_at
            lim = self.limits()[section]
            silent = now - since
            if lim.source == "heartbeat" or silent < lim.seconds:  # unmeasured: the provider's to time
                return None
            return self._fire(section, lim, silent)

    def _fire(self, section: str, lim: Limit, silent: float) -> dict[str, Any]:
        """Record the firing (the lock is held)."""
        self.fired = {
            "section": section,
            "timeout_s": round(lim.seconds, 3),
            "silent_s": round(silent, 3),
            "source": lim.source,
            "step": self.last_step,
            "saving_step": self._saving[0] if self._saving is not None else None,
            "fired_at": time.time(),
            "silent_since": time.time() - silent,
        }
        if section == "section" and self._section is not None:
            self.fired["name"] = self._section[0]
        return self.fired

    @contextlib.contextmanager
    def guard(self, kill: Callable[[], None], name: str = "") -> Iterator[None]:
        """While the block runs, check every TICK_S and call `kill` (the provider's release) once, at the
        first timeout."""
        done = threading.Event()

        def tick() -> None:
            while not done.wait(TICK_S):
                fired = self.check(self.clock())
                if fired is None:
                    continue
                log.warning("%s: %s; killing it", name or "worker", describe(fired))
                try:
                    kill()
                except Exception as e:  # the watch's own release() still runs after it returns
                    log.warning("%s: the watchdog's kill failed: %s", name or "worker", e)
                return

        thread = threading.Thread(target=tick, name="spotrun-watchdog", daemon=True)
        thread.start()
        try:
            yield
        finally:
            done.set()
            thread.join(timeout=KILL_JOIN_S)

    def finish(self, result: WatchResult) -> WatchResult:
        """Put the firing (if any) and the calibration into the result: `hung`, `facts["watchdog"]`."""
        with self._lock:
            diverged = result.trainer_code == ExitCode.DIVERGED.name
            if self.fired is None and self.spikes is not None and diverged:
                # the loss went NaN or infinite: the sharpest spike, rolled back by the same rule
                first = result.last_step + 1
                self._rule_fired(
                    "loss_spike",
                    f"loss spike: not finite at step {first}",
                    {"first_bad_step": first, "last_good_step": self.spikes.last_good_step, "diverged": True},
                )
            facts: dict[str, Any] = {
                "limits": {s: lim.as_dict() for s, lim in self.limits().items()},
                "measured": measured(self.starts, list(self.steps), list(self.saves)).as_dict(),
                "enabled": self.opts.enabled,
            }
            if self.fired is not None:
                facts["fired"] = dict(self.fired)
                result.hung = facts
            result.facts["watchdog"] = facts
        return result


def watched(
    provider: Provider,
    worker: Worker,
    dog: ProgressWatchdog | None,
    *,
    on_status: StatusCallback,
    on_log: LogCallback,
) -> WatchResult:
    """`provider.watch`, guarded by the progress watchdog when there is one (it kills through `release`)."""
    if dog is None:
        return provider.watch(worker, on_status, on_log)
    with dog.guard(lambda: provider.release(worker), worker.id):
        try:
            result = provider.watch(worker, on_status, on_log)
        except StopWorker as e:
            if e.cause is not StopCause.WATCHDOG:
                raise
            log.warning("%s: %s; stopped for a fresh worker", worker.id, e)
            result = stopped(provider, worker, e.cause)  # its emergency checkpoint, then gone
    return dog.finish(result)


def for_attempt(
    opts: WatchdogOptions, history: Sequence[AttemptRecord], fallback_s: float
) -> ProgressWatchdog:
    """The watchdog of the next attempt, calibrated by its job's history (rows oldest first)."""
    return ProgressWatchdog(opts, history_figures(r.extra for r in reversed(history)), fallback_s)


def job_history(store: HistoryStore, job: str, records: Sequence[AttemptRecord]) -> list[AttemptRecord]:
    """The job's attempts in SQL (any job run), oldest first, and this run's not yet there; only this
    run's when the database is down (the watchdog then falls back sooner, never fails the attempt)."""
    try:
        rows: list[AttemptRecord] = list(store.attempts(job=job, limit=HISTORY_ROWS))
    except StoreUnavailable as e:
        log.warning("watchdog: no history from SQL (%s); this run's attempts only", e)
        rows = []
    seen = {(r.worker_id, r.attempt) for r in rows}
    return rows + [r for r in records if (r.worker_id, r.attempt) not in seen]
