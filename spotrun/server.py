"""A Prefect API to run flows against: the one PREFECT_API_URL names, or a local server started here.

`PrefectServer` runs `prefect server start` on a free loopback port, in its own process group, with
SQLite under its PREFECT_HOME; it is ready when /api/health answers (7-14 s on a fresh database on
2 cores, 3-5 s on an existing one) and stops on SIGTERM to the group. The tests, the demo and
`spotrun run` use it.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from trainer.errors import SpotrunError


class ServerStartError(SpotrunError):
    """The local Prefect server did not come up; the message names its log."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class PrefectServer:
    """`prefect server start` on 127.0.0.1, SQLite under `home`; its output goes to home/server.log."""

    def __init__(self, home: Path, port: int | None = None, die_with_parent: bool = True) -> None:
        self.home, self.port = home, port or free_port()
        self.die_with_parent = die_with_parent  # False: it may outlive this process (--keep-server)
        self.api_url = f"http://127.0.0.1:{self.port}/api"
        self.proc: subprocess.Popen[bytes] | None = None
        self.log = home / "server.log"

    def env(self) -> dict[str, str]:
        return {
            "PREFECT_HOME": str(self.home),
            "PREFECT_API_URL": self.api_url,
            # The UI asks this for its API; the default (port 4200) is wrong on a free port.
            "PREFECT_SERVER_UI_API_URL": self.api_url,
            "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
            "DO_NOT_TRACK": "1",  # nor the client's telemetry (read when prefect is first imported)
            "PREFECT_SERVER_LOGGING_LEVEL": "WARNING",
        }

    def spawn(self) -> subprocess.Popen[bytes]:
        """Start `prefect server start` (not waiting for it). Unless told otherwise it dies with this
        process (parent-death signal): a SIGKILLed demo or test leaves no server holding the database."""
        from tasks.providers.processes import die_with_parent, on_spawner_thread

        self.home.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1"]
        cmd += ["--port", str(self.port)]
        env = {**os.environ, **self.env()}
        env.pop("PREFECT_API_URL", None)  # the server itself must not talk to another server
        preexec = die_with_parent() if self.die_with_parent else None

        def popen() -> subprocess.Popen[bytes]:
            with open(self.log, "wb") as out:
                return subprocess.Popen(
                    cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                    preexec_fn=preexec,
                )  # fmt: skip

        self.proc = on_spawner_thread(popen)
        return self.proc

    def start(self, timeout_s: float = 90) -> PrefectServer:
        """Start the server and wait until /api/health answers; ServerStartError (naming the log) if not."""
        self.spawn()
        assert self.proc is not None
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise ServerStartError(f"prefect server exited with {self.proc.returncode}; see {self.log}")
            try:
                with urllib.request.urlopen(f"{self.api_url}/health", timeout=2) as r:
                    if r.status == 200:
                        return self
            except OSError:
                time.sleep(0.3)
        self.stop()
        raise ServerStartError(f"prefect server not healthy after {timeout_s:.0f} s; see {self.log}")

    def stop(self) -> None:
        """SIGTERM the server's process group; SIGKILL it if it is not gone within 15 s."""
        if self.proc is None or self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


@dataclass(frozen=True)
class PrefectApi:
    """The API flows run against; `server` is set when it was started here."""

    url: str
    server: PrefectServer | None

    @property
    def ui_url(self) -> str:
        from prefect.settings import PREFECT_UI_URL

        return str(PREFECT_UI_URL.value() or self.url.removesuffix("/api"))

    def flow_run_url(self, flow_run_id: object) -> str:
        return f"{self.ui_url}/runs/flow-run/{flow_run_id}"


@contextmanager
def prefect_api(home: Path, *, use_env: bool = True, keep: bool = False) -> Iterator[PrefectApi]:
    """The server PREFECT_API_URL names (when `use_env` and it is set), as is; otherwise a local server
    under home/"prefect", started now and stopped on exit unless `keep`. The body runs with
    PREFECT_API_URL pointing at it (trainer subprocesses inherit it through the environment too)."""
    url = os.environ.get("PREFECT_API_URL", "").strip() if use_env else ""
    server = None if url else PrefectServer(home / "prefect", die_with_parent=not keep).start()
    api = PrefectApi(server.api_url, server) if server is not None else PrefectApi(url, None)
    try:
        with patched_environ(**(server.env() if server is not None else {})):
            from prefect.settings import PREFECT_API_URL, temporary_settings

            with temporary_settings({PREFECT_API_URL: api.url}):
                try:
                    yield api
                finally:
                    flush_to_api()
    finally:
        if server is not None and not keep:
            server.stop()


@contextmanager
def patched_environ(**values: str) -> Iterator[None]:
    """Set environment variables for the body (child processes inherit them); restore them after."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def flush_to_api(timeout_s: float = 5.0) -> None:
    """Send the logs and events still queued in this process; without it a server stopped right after
    a flow run misses the run's last log lines."""
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker

    APILogWorker.drain_all(timeout=timeout_s)
    EventsWorker.drain_all(timeout=timeout_s)
