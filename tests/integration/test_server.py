"""`spotrun server start|status|stop`: one background Prefect server per SPOTRUN_HOME, found and checked
by every command, left running across commands, stopped cleanly."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from spotrun.server import choose_api, healthy, running_server, server_home
from tests.prefect_server import seed
from tests.trainer_runs import REPO


def spotrun(home: Path, *argv: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env |= {"PYTHONPATH": str(REPO), "SPOTRUN_HOME": str(home)}
    cmd = [sys.executable, "-m", "spotrun.cli", *argv]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=150)


@pytest.mark.timeout(300)
def test_background_server_start_status_reuse_stop(tmp_path: Path) -> None:
    home = tmp_path / "home"
    seed(server_home(home))  # migrated tables: the start takes 4 s instead of 12
    down = spotrun(home, "server", "status")
    assert down.returncode == 1 and "no background Prefect server is running" in down.stdout
    started = spotrun(home, "server", "start", "--port", "0")
    try:
        assert started.returncode == 0, started.stdout + started.stderr
        state = json.loads((server_home(home) / "server.json").read_text())
        assert "Prefect server started" in started.stdout and state["api_url"] in started.stdout
        assert healthy(state["api_url"])
        assert "export PREFECT_API_AUTH_STRING=" in started.stdout and "auth_string" in started.stdout
        made = [home, *home.rglob("*")]  # the home and the server's files: nothing for others
        assert {"auth_string", "encryption_key", "server.json"} <= {p.name for p in made}
        assert [p for p in made if p.stat().st_mode & 0o077] == []

        again = spotrun(home, "server", "start")  # nothing to do: the same server, at once
        assert again.returncode == 0 and "already running" in again.stdout
        assert "starting a Prefect server" not in again.stdout
        up = spotrun(home, "server", "status")
        assert up.returncode == 0 and f"pid {state['pid']}" in up.stdout

        found = running_server(home)
        assert found is not None and found.pid == state["pid"]
        api = choose_api(home, use_env=False, background="reuse")  # what spotrun run, serve, deploy do
        assert (api.url, api.source, api.started) == (state["api_url"], "background", False)
    finally:
        stopped = spotrun(home, "server", "stop")
    assert stopped.returncode == 0 and f"pid {state['pid']}" in stdout_of(stopped)
    assert not Path(f"/proc/{state['pid']}").exists() or b"Z" in _proc_state(state["pid"])
    assert not healthy(state["api_url"], timeout_s=1)
    assert spotrun(home, "server", "status").returncode == 1
    assert "no background Prefect server" in spotrun(home, "server", "stop").stdout
    assert (server_home(home) / "server.log").is_file()  # the database and log stay for the next start


def stdout_of(r: subprocess.CompletedProcess[str]) -> str:
    return r.stdout + r.stderr


def _proc_state(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/stat").read_bytes().rpartition(b")")[2].split()[0]
    except (OSError, IndexError):
        return b"Z"


def test_a_stale_state_file_is_not_a_server(tmp_path: Path) -> None:
    """A pid file left by a crash, its pid reused by another process: not running, and not signalled."""
    server_home(tmp_path).mkdir(parents=True)
    state = {"pid": os.getpid(), "api_url": "http://127.0.0.1:9/api", "started_at": 0, "log": "x"}
    (server_home(tmp_path) / "server.json").write_text(json.dumps(state))
    assert running_server(tmp_path) is None
    r = spotrun(tmp_path, "server", "stop")
    assert r.returncode == 0 and "no background Prefect server is running" in r.stdout  # and we live
    api = choose_api(tmp_path, use_env=False, background="reuse")
    assert (api.url, api.source) == ("", "temporary")  # the caller starts a temporary server
