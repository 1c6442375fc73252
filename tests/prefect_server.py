"""A real Prefect server on a free loopback port, for the flow tests and the demo.

`prefect server start` in its own process group, SQLite under a temp PREFECT_HOME; ready when
/api/health answers (7-14 s measured on 2 cores). Stopped by SIGTERM to the group.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class PrefectServer:
    def __init__(self, home: Path, port: int | None = None) -> None:
        self.home, self.port = home, port or free_port()
        self.api_url = f"http://127.0.0.1:{self.port}/api"
        self.proc: subprocess.Popen[bytes] | None = None
        self.log = home / "server.log"

    def env(self) -> dict[str, str]:
        return {
            "PREFECT_HOME": str(self.home),
            "PREFECT_API_URL": self.api_url,
            "PREFECT_SERVER_UI_API_URL": self.api_url,
            "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
            "PREFECT_SERVER_LOGGING_LEVEL": "WARNING",
        }

    def start(self, timeout_s: float = 90) -> PrefectServer:
        self.home.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1", "--port", str(self.port)]
        env = {**os.environ, **self.env()}
        env.pop("PREFECT_API_URL", None)  # the server itself must not talk to another server
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"prefect server exited with {self.proc.returncode}; see {self.log}")
            try:
                with urllib.request.urlopen(f"{self.api_url}/health", timeout=2) as r:
                    if r.status == 200:
                        return self
            except OSError:
                time.sleep(0.3)
        self.stop()
        raise RuntimeError(f"prefect server not healthy after {timeout_s:.0f} s; see {self.log}")

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
