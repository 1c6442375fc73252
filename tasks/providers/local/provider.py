"""The local provider: each worker is a `python -P -m spotrun.trainer` subprocess, watched by a spot-market
simulator.

The simulator rehearses what a spot market does to a job before anyone pays for GPUs: after a planned
time of training it sends a notice (SIGTERM to the trainer's process group) and, if the trainer is still
there `notice_s` later, a hard kill (SIGKILL to its whole session); some reclaims come with no notice.
Times count from the attempt's `started` status line, so interpreter start-up and `import torch` never
use up a planned interval. A worker that stops writing lines is killed and reported lost.

With a capacity trace (`trace`, market.py) the market is measured rather than drawn: a spot worker
starts in a zone that has capacity at the replay's tick (none: a retryable ProvisionError), gets the
same notice the moment its zone's capacity is 0, started or not (a real market does not wait for
`import torch`), and each attempt is priced; on-demand workers are always placed and never reclaimed.

A trainer never outlives the process that started it: it runs in its own session (signals reach it
and its data-loader workers, which leave its process group but not its session) and with
PR_SET_PDEATHSIG=SIGKILL, so a flow process that is SIGKILLed or cancelled takes its trainer along. A
trainer forked by a pool's server (`pool`, pool.py) is that server's child: the server SIGKILLs its
session when the flow process's connection closes.
"""

from __future__ import annotations

import logging
import os
import queue
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING

from spotrun.tasks.market.prices import Prices
from spotrun.tasks.providers.base import (
    KillReason,
    LogCallback,
    Market,
    NoticeKind,
    ProvisionError,
    StatusCallback,
    StopCause,
    WarmSettings,
    WatchResult,
    Worker,
    stop_cause,
)
from spotrun.tasks.providers.local import fork_server, pool
from spotrun.tasks.providers.local.config import (
    LocalProviderConfig,
    plan_preemption,
    simulator_rng,
)
from spotrun.tasks.providers.local.market import TraceMarket
from spotrun.tasks.providers.processes import (
    Proc,
    die_with_parent,
    exited,
    kill_leftovers,
    on_spawner_thread,
    signal_group,
)
from spotrun.tasks.providers.trainer_env import trainer_env
from spotrun.trainer.home import spotrun_home
from spotrun.trainer.interpreter import python_m, worker_path
from spotrun.trainer.storage.base import local_dir_name
from spotrun.trainer.telemetry.records import Durable, Record, Started, Step
from spotrun.trainer.telemetry.status import parse_status_line

if TYPE_CHECKING:
    from spotrun.trainer.spec.job import JobSpec


log = logging.getLogger(__name__)

TICK_S = 0.1  # how often the watcher checks the clock when no line arrives
DRAIN_BATCH = 1000
EOF_GRACE_S = 5.0  # after the trainer is gone, how long to wait for the last lines of its pipes
TAIL_LINES, TAIL_BYTES, MAX_LINE = 60, 8192, 16384
STEP_SAMPLES = 4096  # (t, step) samples kept for productive-time accounting (about an hour at 1/s)


@dataclass
class _Handle:
    proc: Proc
    events: queue.Queue[_Event]
    readers: list[threading.Thread]
    started_mono: float
    released_at: float | None = None
    market: TraceMarket | None = None  # the trace replay the worker was placed by
    clock: Callable[[], float] = time.time  # the replay's clock


@dataclass(frozen=True)
class _Event:
    stream: str  # "out" | "err"
    line: str | None  # None: end of stream
    mono: float
    wall: float


class LocalProvider:
    """Workers are local trainer subprocesses; see the module docstring for how they die."""

    name = "local"

    def __init__(
        self,
        cfg: LocalProviderConfig | None = None,
        flow_run_id: str | None = None,
        clock: Callable[[], float] = time.time,
        *,
        home: Path | None = None,
    ) -> None:
        self.cfg = cfg or LocalProviderConfig()
        # a pool's socket lives under SPOTRUN_HOME (read here only when a pool is named)
        self.pool = (
            None
            if self.cfg.pool is None
            else pool.Place(pool.pools_dir(home or spotrun_home()), self.cfg.pool)
        )
        self.prewarm = self.cfg.prewarm
        self.warm = WarmSettings(self.cfg.warm, self.cfg.warm_idle_s)  # standby trainers (control/warm.py)
        self.heartbeat_timeout_s = self.cfg.heartbeat_timeout_s
        self.rebalance_wait_s: float | None = None  # no cloud here sends rebalance recommendations
        self.flow_run_id = flow_run_id  # named in the storage lease (SPOTRUN_FLOW_RUN_ID)
        self.market = TraceMarket.of(self.cfg)  # one replay clock for all this provider's workers
        self.capacity_poll_s = 30.0  # a spot market without capacity: asked again this often
        self.prices: Prices | None = self.cfg.prices()
        if self.market is not None:  # a replay: look again each tick
            self.capacity_poll_s = self.market.traces[0].gap_s / self.market.compress
        self.clock = clock  # the replay's (a test moves it to a tick of its choosing)

    def provision(
        self, job: JobSpec, attempt: int, spec_path: Path, extra_args: list[str], *, market: Market = "spot"
    ) -> Worker:
        """Start the trainer for `attempt`; returns once the process exists (training starts later)."""
        if not spec_path.is_file():
            raise ProvisionError(f"job file {spec_path} does not exist", retryable=False)
        zone = self.market.place(market, self.clock()) if self.market is not None else ""
        # Keyed by storage too: two jobs sharing a name must not share a cache. No --worker-id: the
        # trainer's default lease holder is `local-<pid>`, this worker's id, and a heartbeat is not needed.
        work = worker_dir(Path(self.cfg.workdir or ".spotrun/local"), job)
        cache = work / "cache" if self.cfg.keep_cache else work / f"attempt-{attempt}" / "cache"
        args = ["--config", str(spec_path.resolve()), "--storage", job.storage, "--cache", str(cache)]
        args += ["--metrics", str(work / "metrics.jsonl"), *extra_args]
        if self.prewarm:  # the simulator's SIGTERM comes notice_s before its SIGKILL: train through half
            window = f"{self.cfg.notice_s:g}"
            args += ["--handover-s", window, "--sigterm-window-s", window]
        work.mkdir(parents=True, exist_ok=True)
        # The controller's directory, named: `python -P` leaves it off sys.path and PYTHONPATH puts it
        # first, as `python -m` there would (trainer/interpreter.py)
        cwd = Path.cwd()
        cmd = python_m("spotrun.trainer", *args, python=self.cfg.python)
        env = _child_env(job, self.flow_run_id, cwd)
        proc = self._start(cmd, "spotrun.trainer", args, env=env, cwd=cwd)
        handle = _Handle(proc, queue.Queue(), [], time.monotonic(), market=self.market, clock=self.clock)
        for pipe, stream in ((proc.stdout, "out"), (proc.stderr, "err")):
            t = threading.Thread(target=_read_lines, args=(pipe, stream, handle.events), daemon=True)
            t.start()
            handle.readers.append(t)
        where = f" in {zone}" if zone else ""
        log.info("attempt %d (%s%s): trainer pid %d: %s", attempt, market, where, proc.pid, shlex.join(cmd))
        return Worker(
            f"local-{proc.pid}",
            self.name,
            attempt,
            started_at=time.time(),
            handle=handle,
            market=market,
            zone=zone,
        )

    def _start(self, cmd: list[str], module: str, args: list[str], *, env: dict[str, str], cwd: Path) -> Proc:
        """`cmd` (`python_m(module, *args)`) in `cwd`: forked from a fork server, or a fresh process."""
        # Only for the flow's own interpreter: a configured `python` may be a wrapper (a profiler, `nice`,
        # a container entry point) that a fork from this interpreter would skip.
        own = self.cfg.python is None or os.path.abspath(self.cfg.python) == os.path.abspath(sys.executable)
        if self.cfg.fork_server and own:
            try:
                if self.pool is not None:
                    idle_s = self.cfg.pool_idle_s
                    return pool.spawn(self.pool, cmd[0], module, args, env=env, cwd=cwd, idle_s=idle_s)
                return fork_server.spawn(cmd[0], module, args, env=env, cwd=cwd)
            except (fork_server.ForkServerUnavailable, OSError) as e:  # not an error: a slower start
                log.warning("trainer fork server unavailable (%s); starting a fresh process", e)
        try:
            return _spawn(cmd, env, cwd)
        except (OSError, subprocess.SubprocessError) as e:
            shown = shlex.join(cmd[: len(cmd) - len(args)])
            raise ProvisionError(f"cannot start {shown}: {e}", retryable=False) from e

    def watch(
        self, worker: Worker, on_status: StatusCallback | None = None, on_log: LogCallback | None = None
    ) -> WatchResult:
        """Stream lines to the callbacks (in this thread), run the simulator and the heartbeat check,
        and return once the trainer and everything in its session are gone."""
        return _Watch(self.cfg, worker, on_status, on_log).run()

    def stop(self, worker: Worker, cause: StopCause) -> WatchResult:
        """SIGTERM the trainer (its emergency checkpoint), read its lines, including all it wrote while
        nobody watched, for up to `stop_grace_s`, then SIGKILL what is left: an interrupted watch's stop."""
        return _Watch(self.cfg, worker, None, None).stop(cause)

    def stop_leftovers(self, flow_run_id: str) -> list[str]:
        """[]: a dead controller's local trainer is found by its pid file
        (tasks/ownership/adoption.py), not here."""
        return []

    def release(self, worker: Worker) -> None:
        """SIGKILL whatever is left of the worker's session, reap it, close its pipes. Idempotent."""
        h: _Handle = worker.handle
        if h.proc.returncode is None:
            if h.released_at is None and not exited(h.proc):
                h.released_at = time.time()  # watch() reports it as killed by release
            kill_leftovers(h.proc)
            try:
                h.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:  # stuck in the kernel (D state): nothing more to do here
                log.warning("trainer pid %d did not die within 30 s of SIGKILL", h.proc.pid)
        for t in h.readers:
            t.join(timeout=2)
        if any(t.is_alive() for t in h.readers):
            return  # a process outside the session holds a pipe; closing it now would block on the reader
        for pipe in (h.proc.stdout, h.proc.stderr):
            if pipe is not None and not pipe.closed:
                pipe.close()


class _Watch:
    """One watch of one worker: all state lives in the calling thread; reader threads only enqueue."""

    def __init__(
        self,
        cfg: LocalProviderConfig,
        worker: Worker,
        on_status: StatusCallback | None,
        on_log: LogCallback | None,
    ) -> None:
        self.cfg, self.worker, self.h = cfg, worker, worker.handle
        self.on_status, self.on_log = on_status, on_log
        self.plan = plan_preemption(
            cfg.simulator, worker.attempt, simulator_rng(cfg.simulator.seed, worker.attempt)
        )
        self.result = worker.result = WatchResult(started_at=worker.started_at)  # also read on interrupt
        # start-up counts from the watch: a standby trainer (tasks/control/warm.py) may have waited on the
        # lease for longer than startup_timeout_s before its attempt began
        self.began = max(self.h.started_mono, time.monotonic())
        self.last_line = self.began
        self.training_mono: float | None = None
        self.hard_kill_at: float | None = None
        self.tail: deque[str] = deque(maxlen=TAIL_LINES)
        self.steps: deque[tuple[float, int]] = deque(maxlen=STEP_SAMPLES)
        self.open_streams = len(self.h.readers)

    def run(self) -> WatchResult:
        proc = self.h.proc
        try:
            while not exited(proc):
                self._drain(self._until_next_check(time.monotonic()))
                now = time.monotonic()
                self._simulate(now)
                self._check_heartbeat(now)
        except BaseException as e:  # a cancel (Prefect's TerminationSignal), Ctrl-C, or a callback's error
            self.stop(stop_cause(e))
            raise
        return self._reap()

    def stop(self, cause: StopCause) -> WatchResult:
        """The controller is going away: SIGTERM the trainer (its emergency-checkpoint path), keep reading
        its lines for up to `stop_grace_s`, then SIGKILL what is left; the result stays on the worker."""
        self.result.stopped_by = cause
        self.on_status = self.on_log = None  # the flow is being torn down: only fold records from here on
        if not exited(self.h.proc):
            log.warning(
                "%s: stopping the trainer (SIGTERM, %.0f s grace): %s",
                self.worker.id,
                self.cfg.stop_grace_s,
                cause,
            )
            signal_group(self.h.proc.pid, signal.SIGTERM)
            deadline = time.monotonic() + self.cfg.stop_grace_s
            try:
                while not exited(self.h.proc) and time.monotonic() < deadline:
                    self._drain(TICK_S)
            except BaseException:  # a second Ctrl-C or SIGTERM: no more grace
                log.warning("%s: second interrupt; killing the trainer now", self.worker.id)
        if not exited(self.h.proc):
            self._kill(KillReason.STOP_GRACE)
        return self._reap()

    def _reap(self) -> WatchResult:
        proc = self.h.proc
        self.result.ended_at = time.time()
        kill_leftovers(proc)  # before reaping: a zombie leader keeps its pid (and session id) from reuse
        rc = proc.wait()
        deadline = time.monotonic() + EOF_GRACE_S
        while self.open_streams and time.monotonic() < deadline:
            self._drain(TICK_S)
        self._drain(0)
        return self._finish(rc)

    def _drain(self, timeout: float) -> None:
        """Handle queued lines: wait up to `timeout` for the first, then at most a batch, so that a
        chatty trainer cannot starve the clock checks."""
        try:
            ev = self.h.events.get(timeout=timeout) if timeout else self.h.events.get_nowait()
            for _ in range(DRAIN_BATCH):
                self._handle(ev)
                ev = self.h.events.get_nowait()
            self._handle(ev)
        except queue.Empty:
            return

    def _handle(self, ev: _Event) -> None:
        if ev.line is None:
            self.open_streams -= 1
            return
        self.last_line = max(self.last_line, ev.mono)
        rec = parse_status_line(ev.line) if ev.stream == "out" else None
        if rec is None:
            self.tail.append(ev.line[:1000])
            if self.on_log is not None:
                self.on_log(ev.line)
            return
        self._record(rec, ev)
        if self.on_status is not None:
            self.on_status(rec)

    def _record(self, rec: Record, ev: _Event) -> None:
        r = self.result
        r.fold(rec)
        if isinstance(rec, Started):
            self.training_mono, r.started_training_at = ev.mono, ev.wall
            self.steps.append((ev.wall, rec.step))
        elif isinstance(rec, Step):
            self.steps.append((ev.wall, rec.step))
        elif isinstance(rec, Durable):
            r.durable_times.append((ev.wall, rec.step))

    def _until_next_check(self, now: float) -> float:
        """How long to wait for a line before the clock checks: TICK_S, or less when a planned reclaim
        or the notice's hard kill falls due sooner. Checked when the next line arrived (the trainer's
        lines come more often than TICK_S), a reclaim came right after a `durable` record, before any
        step past that checkpoint: a reclaim without notice lost nothing, unlike a real one (the
        tracking test's replay found no lost steps to compare, every time with a 0.8 s reclaim)."""
        due = now + TICK_S
        if self.hard_kill_at is not None:
            due = min(due, self.hard_kill_at)
        if self.plan is not None and self.training_mono is not None and self.result.notice_kind is None:
            due = min(due, self.training_mono + self.plan.after_s)
        return max(0.0, due - now)

    def _simulate(self, now: float) -> None:
        r = self.result
        if self.hard_kill_at is not None and now >= self.hard_kill_at:
            self.hard_kill_at = None
            self._kill(KillReason.NOTICE_WINDOW)
            return
        if r.notice_kind is not None or r.exit is not None:
            return  # an attempt that has reported its exit is over: a reclaim now would only blur it
        if self.h.market is not None:
            self._replay(now, self.h.market)
            return
        if self.plan is None or self.training_mono is None or now - self.training_mono < self.plan.after_s:
            return
        after = self.plan.after_s
        if self.plan.notice:
            log.info("spot simulator: notice (SIGTERM) to %s after %.2f s of training", self.worker.id, after)
            self._notice(now, NoticeKind.SIM_NOTICE)
        else:
            r.notice_kind = NoticeKind.SIM_NO_NOTICE
            log.info("spot simulator: %s reclaimed without notice after %.2f s", self.worker.id, after)
            self._kill(KillReason.NO_NOTICE)

    def _replay(self, now: float, market: TraceMarket) -> None:
        """The trace's reclaim: a notice the moment the worker's zone has no capacity left."""
        w = self.worker
        tick = market.reclaimed_at(w.market, w.zone, self.h.clock())
        if tick is None:
            return
        self.result.facts["trace"] = {"zone": w.zone, "reclaimed_at_tick": tick}
        log.info(
            "spot simulator: no capacity in %s at trace tick %d: notice (SIGTERM) to %s, SIGKILL in %g s",
            w.zone,
            tick,
            w.id,
            self.cfg.notice_s,
        )
        self._notice(now, NoticeKind.SIM_TRACE)

    def _notice(self, now: float, kind: NoticeKind) -> None:
        """SIGTERM now, SIGKILL once `notice_s` has passed (`_simulate`) if the trainer is still there."""
        r = self.result
        r.notice_kind, r.notice_at = kind, time.time()
        self.hard_kill_at = now + self.cfg.notice_s
        signal_group(self.h.proc.pid, signal.SIGTERM)

    def _check_heartbeat(self, now: float) -> None:
        r = self.result
        if r.killed_at is not None or r.notice_kind is not None:
            return  # already on its way out
        if self.training_mono is None:
            silent, limit = now - self.began, self.cfg.startup_timeout_s
        else:
            silent, limit = now - self.last_line, self.cfg.heartbeat_timeout_s
        if silent >= limit:
            r.lost, r.silent_s = True, round(silent, 1)
            log.warning("%s: no progress for %.1f s; killing it", self.worker.id, silent)
            self._kill(KillReason.LOST)

    def _kill(self, reason: KillReason) -> None:
        r = self.result
        if r.killed_at is None:
            r.killed_at, r.kill_reason = time.time(), reason
        kill_leftovers(self.h.proc)

    def _finish(self, rc: int) -> WatchResult:
        r = self.result
        r.exit_code, r.signal = (rc, None) if rc >= 0 else (None, -rc)
        if r.killed_at is None and self.h.released_at is not None:
            r.killed_at, r.kill_reason = self.h.released_at, KillReason.RELEASE
        r.step_times = list(self.steps)
        r.log_tail = "\n".join(self.tail)[-TAIL_BYTES:]
        if self.h.market is not None:  # priced like an EC2 attempt: the attempts table and the summary
            w, market = self.worker, self.h.market
            r.facts["cost"] = market.cost(w.market, w.zone, started_at=w.started_at, ended_at=r.ended_at)
        return r


def _read_lines(pipe: IO[str], stream: str, events: queue.Queue[_Event]) -> None:
    try:
        for line in pipe:
            events.put(_Event(stream, line.rstrip("\n")[:MAX_LINE], time.monotonic(), time.time()))
    except (OSError, ValueError):  # release() closed the pipe under us: the worker is gone anyway
        pass
    finally:
        events.put(_Event(stream, None, time.monotonic(), time.time()))


def build(cfg: LocalProviderConfig, workdir: Path, flow_run_id: str | None) -> LocalProvider:
    """The registry's factory (tasks/providers/registry.py): workers keep their files under `workdir`
    unless the settings name a directory."""
    return LocalProvider(cfg if cfg.workdir is not None else cfg.placed(workdir), flow_run_id)


def worker_dir(workdir: Path, job: JobSpec) -> Path:
    """Where a job's local workers keep their cache and metrics.jsonl under `workdir`."""
    return workdir.resolve() / local_dir_name(job.name, job.storage)


# Local workers share their cores with the controller, the Prefect server and, at a handover, a second
# trainer. OpenMP threads that spin while they wait then burn the cores the others need: the demo beside
# one busy core took 79 s (92 s of CPU) with spinning threads and 49 s (46 s) with sleeping ones
# (measured). How threads wait changes no result: the bitwise tests run with it.
OMP_WAIT = {"OMP_WAIT_POLICY": "PASSIVE"}


def _child_env(job: JobSpec, flow_run_id: str | None = None, cwd: Path | None = None) -> dict[str, str]:
    """The flow's environment as a trainer may see it (allow-list and the job's `env`, trainer_env.py),
    a worker's PYTHONPATH (`cwd`, where a loop beside the job file lives, then the environment's own:
    trainer/interpreter.py), unbuffered output (lines are heartbeats), OpenMP threads
    that sleep while they wait (unless the environment says otherwise)."""
    env = trainer_env(os.environ, job.env)
    path = os.pathsep.join(worker_path(cwd, env.get("PYTHONPATH")))
    run = {"SPOTRUN_FLOW_RUN_ID": flow_run_id} if flow_run_id else {}
    return {**OMP_WAIT, **env, "PYTHONPATH": path, "PYTHONUNBUFFERED": "1", **run}


def _spawn(cmd: list[str], env: dict[str, str], cwd: Path) -> subprocess.Popen[str]:
    return on_spawner_thread(lambda: _popen(cmd, env, cwd))


def _popen(cmd: list[str], env: dict[str, str], cwd: Path) -> subprocess.Popen[str]:
    return subprocess.Popen(
        cmd,
        cwd=cwd,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        encoding="utf-8",
        errors="replace",
        env=env,
        start_new_session=True,
        preexec_fn=die_with_parent(),
    )
