"""A Prefect process worker on this machine, so deployment runs (from the UI, the scheduler or an
automation) execute here: `prefect worker start --pool spotrun-local` as a supervised subprocess.

Each flow run is a child process of the worker, started in the worker's environment: SPOTRUN_HOME,
SPOTRUN_DATABASE_URL and the Slack settings reach the training and alert flows through it.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from prefect import get_client

from tasks.providers.local import die_with_parent, on_spawner_thread
from trainer.errors import SpotrunError

POOL = "spotrun-local"


class WorkerStartError(SpotrunError):
    """The worker exited or did not register with the server; the message names its log."""


class LocalWorker:
    """`prefect worker start` in its own session; stopped with TERM, a second TERM, then KILL."""

    def __init__(self, log: Path, pool: str = POOL, query_s: float = 5.0, limit: int | None = None) -> None:
        self.log, self.pool, self.query_s, self.limit = log, pool, query_s, limit
        self.name = f"spotrun-{socket.gethostname()}-{os.getpid()}"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout_s: float = 60) -> LocalWorker:
        """Start the worker and wait until the server lists it in the pool."""
        cmd = [sys.executable, "-m", "prefect", "worker", "start", "--pool", self.pool, "--type", "process"]
        cmd += ["--name", self.name] + (["--limit", str(self.limit)] if self.limit else [])
        # How often it asks for runs; the default 10 s would add up to 10 s to every alert.
        env = {**os.environ, "PREFECT_WORKER_QUERY_SECONDS": f"{self.query_s:g}"}
        self.log.parent.mkdir(parents=True, exist_ok=True)

        def popen() -> subprocess.Popen[bytes]:  # dies with this process: no worker pulls runs for nobody
            with open(self.log, "ab") as out:
                return subprocess.Popen(
                    cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                    preexec_fn=die_with_parent(),
                )  # fmt: skip

        self.proc = on_spawner_thread(popen)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise WorkerStartError(f"prefect worker exited with {self.proc.returncode}; see {self.log}")
            if self._registered():
                return self
            time.sleep(0.5)
        self.stop()
        raise WorkerStartError(f"prefect worker did not register within {timeout_s:.0f} s; see {self.log}")

    def _registered(self) -> bool:
        with get_client(sync_client=True) as client:
            return any(w.name == self.name for w in client.read_workers_for_work_pool(self.pool))

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
