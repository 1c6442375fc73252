"""A Prefect process worker on this machine, so deployment runs (from the UI, the scheduler or an
automation) execute here: `prefect worker start --pool spotrun-local` as a supervised subprocess.

Each flow run is a child process of the worker, started in the worker's environment: SPOTRUN_HOME,
SPOTRUN_DATABASE_URL and the Slack settings reach the training and alert flows through it.

`supervise` restarts a worker that dies (OOM killer, a crash in the worker itself) after an exponential
backoff, forever: a serve that exits leaves scheduled and automation-started runs unserved, and a worker
dying in a loop is retried at the cap rather than given up on.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import httpx
from prefect import get_client

from spotrun.tasks.providers.processes import die_with_parent, on_spawner_thread
from spotrun.trainer.errors import SpotrunError

POOL = "spotrun-local"


class WorkerStartError(SpotrunError):
    """The worker exited or did not register with the server; the message names its log."""


def worker_name(host: str | None = None) -> str:
    """`spotrun-<host>`: the pool's worker for this machine."""
    return f"spotrun-{host or socket.gethostname()}"


class LocalWorker:
    """`prefect worker start` in its own session; stopped with TERM, a second TERM, then KILL."""

    def __init__(
        self,
        log: Path,
        pool: str = POOL,
        query_s: float = 5.0,
        *,
        limit: int | None = None,
        name: str | None = None,
    ) -> None:
        self.log, self.pool, self.query_s, self.limit = log, pool, query_s, limit
        # One name per host, not per process: each `spotrun serve` after a restart is the same worker to
        # the server, so offline workers do not pile up in the pool.
        self.name = name or worker_name()
        self.proc: subprocess.Popen[bytes] | None = None
        self.started = 0.0  # time.monotonic() at the last start

    def start(self, timeout_s: float = 60, stop: threading.Event | None = None) -> LocalWorker:
        """Start the worker and wait until the server lists it in the pool (or `stop` is set)."""
        cmd = [sys.executable, "-m", "prefect", "worker", "start", "--pool", self.pool, "--type", "process"]
        cmd += ["--name", self.name] + (["--limit", str(self.limit)] if self.limit else [])
        # How often it asks for runs; the default 10 s would add up to 10 s to every alert.
        env = {**os.environ, "PREFECT_WORKER_QUERY_SECONDS": f"{self.query_s:g}"}
        self.log.parent.mkdir(parents=True, exist_ok=True)

        def popen() -> subprocess.Popen[bytes]:  # dies with this process: no worker pulls runs for nobody
            with open(self.log, "ab") as out:
                return subprocess.Popen(
                    cmd,
                    env=env,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                    preexec_fn=die_with_parent(),
                )

        before = self.heartbeat()  # a restart keeps the name: registered means a newer heartbeat
        self.proc = on_spawner_thread(popen)
        self.started = time.monotonic()
        deadline = self.started + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise WorkerStartError(f"prefect worker exited with {self.proc.returncode}; see {self.log}")
            beat = self.heartbeat()
            if beat is not None and beat != before:
                return self
            if stop is not None and stop.is_set():  # serve was told to stop: do not wait out the start
                self.stop()
                raise WorkerStartError("stopped while the worker was starting")
            time.sleep(0.5)
        self.stop()
        raise WorkerStartError(f"prefect worker did not register within {timeout_s:.0f} s; see {self.log}")

    def heartbeat(self) -> datetime | None:
        """The last heartbeat the server has from a worker of this name; None before the first."""
        with get_client(sync_client=True) as client:
            beats = [
                w.last_heartbeat_time
                for w in client.read_workers_for_work_pool(self.pool)
                if w.name == self.name
            ]
        return beats[0] if beats else None

    def exited(self) -> int | None:
        """The worker's exit code once it has exited; None while it runs (or before it started)."""
        return None if self.proc is None else self.proc.poll()

    def stop(self, grace_s: float = 10) -> None:
        """The worker sends SIGINT to its runs on the first TERM and kills them on the second."""
        proc = self.proc
        if proc is None or proc.poll() is not None:
            return
        for sig in (signal.SIGTERM, signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                return
            try:
                proc.wait(timeout=grace_s)
                return
            except subprocess.TimeoutExpired:
                continue


@dataclass
class RestartBackoff:
    """Waits before restarting a dead worker: base, 2·base, 4·base ... capped; a worker that stayed up
    `stable_s` starts the sequence again."""

    base_s: float = 1.0
    cap_s: float = 60.0
    stable_s: float = 300.0
    failures: int = 0

    def next_delay(self, uptime_s: float) -> float:
        """The wait before the next start of a worker that died after `uptime_s` seconds up."""
        self.failures = 1 if uptime_s >= self.stable_s else self.failures + 1
        return min(self.cap_s, self.base_s * 2 ** (self.failures - 1))


def supervise(
    worker: LocalWorker,
    stop: threading.Event,
    say: Callable[[str], None],
    *,
    backoff: RestartBackoff | None = None,
    poll_s: float = 1.0,
) -> None:
    """Keep `worker` running until `stop` is set: a dead worker is restarted after the backoff, and a
    restart that fails to register counts as one more death. The caller stops the worker."""
    backoff = backoff or RestartBackoff()
    while not stop.wait(poll_s):
        code = worker.exited()
        if code is None:
            continue
        uptime = time.monotonic() - worker.started
        delay = backoff.next_delay(uptime)
        say(
            f"worker {worker.name} exited with {code} after {uptime:.0f} s (see {worker.log}); "
            f"restarting in {delay:g} s (restart {backoff.failures})"
        )
        while not stop.wait(delay):
            try:
                worker.start(stop=stop)
                say(f"worker {worker.name} restarted (pid {worker.proc.pid if worker.proc else '?'})")
                break
            except (WorkerStartError, httpx.HTTPError, OSError) as e:  # the server may be down too: retry
                worker.stop()  # a half-started worker must not run beside the next one
                delay = backoff.next_delay(0.0)
                say(f"{e}; retrying in {delay:g} s (restart {backoff.failures})")
