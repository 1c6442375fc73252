"""`supervise` with a hand-written worker: restarts after each death, failed restarts retried, stops."""

from __future__ import annotations

import threading
import time
from pathlib import Path

from spotrun.deployments.worker import LocalWorker, RestartBackoff, WorkerStartError, supervise


class ScriptedWorker(LocalWorker):
    """Exits with the codes given, one per start; the starts listed in `fail` raise; `stop` is set
    once the script is played out."""

    def __init__(self, codes: list[int], fail: set[int], stop: threading.Event) -> None:
        super().__init__(Path("/tmp/worker.log"))
        self.codes, self.fail, self.stop_event = codes, fail, stop
        self.starts = 0
        self.running = True

    def start(self, timeout_s: float = 60, stop: threading.Event | None = None) -> LocalWorker:
        self.starts += 1
        if self.starts in self.fail:
            raise WorkerStartError(f"prefect worker exited with 1; see {self.log}")
        self.running, self.started = True, time.monotonic()
        return self

    def exited(self) -> int | None:
        if not self.codes:
            self.stop_event.set()
            return None
        if self.running:
            self.running = False
            return self.codes.pop(0)
        return None

    def stop(self, grace_s: float = 10) -> None:
        pass


def test_each_death_is_followed_by_a_restart_and_failed_restarts_are_retried() -> None:
    stop = threading.Event()
    worker = ScriptedWorker([-9, 1, -9], fail={2}, stop=stop)
    said: list[str] = []
    supervise(worker, stop, said.append, backoff=RestartBackoff(base_s=0.001, cap_s=0.004), poll_s=0.001)
    assert worker.starts == 4  # three deaths, one restart failed and was retried
    assert said[0].startswith(f"worker {worker.name} exited with -9 after ")
    assert "restarting in 0.001 s (restart 1)" in said[0]
    assert said[1] == f"worker {worker.name} restarted (pid ?)"
    assert "restart 2" in said[2] and said[3].endswith("/tmp/worker.log; retrying in 0.004 s (restart 3)")
    assert [line for line in said if "exited with" in line and "after" in line][-1].endswith("(restart 4)")


def test_a_stop_during_the_backoff_returns_without_restarting() -> None:
    stop = threading.Event()
    worker = ScriptedWorker([-9], fail=set(), stop=stop)
    said: list[str] = []

    def say(line: str) -> None:
        said.append(line)
        stop.set()  # SIGTERM arrives while serve waits to restart

    supervise(worker, stop, say, backoff=RestartBackoff(base_s=60), poll_s=0.001)
    assert worker.starts == 0 and len(said) == 1
