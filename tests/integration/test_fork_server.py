"""The trainer fork server (trainer/launch/zygote.py, tasks/providers/local/fork_server.py): a forked child
is what a fresh `python -P -m MODULE` would have been, and dies as a fresh one would. Real processes, no
mocks; most servers here preload nothing, so they start in milliseconds."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from spotrun.tasks.providers.local import fork_server
from spotrun.tasks.providers.local.fork_server import ForkServer, ForkServerUnavailable, load_key
from spotrun.tasks.providers.processes import exited, kill_leftovers
from tests.procs import wait_gone

REPO = Path(__file__).resolve().parents[2]

CHILD = """
import json, os, signal, sys
print(json.dumps({
    "argv": sys.argv, "cwd": os.getcwd(), "path0": sys.path[0], "env": os.environ.get("CHILD_VAR"),
    "sid": os.getsid(0) == os.getpid(), "ppid": os.getppid(), "stdin": sys.stdin.read(),
    "sigint": signal.getsignal(signal.SIGINT) is signal.default_int_handler,
    "sigterm": signal.getsignal(signal.SIGTERM) == signal.SIG_DFL, "main": __name__,
    "comm": open("/proc/self/comm").read().strip(),
}), flush=True)
print("to stderr", file=sys.stderr, flush=True)
sys.exit(int(sys.argv[1]) if len(sys.argv) > 1 else 0)
"""
SLEEPER = """
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
print(child.pid, flush=True)
time.sleep(120)
"""


@pytest.fixture
def mods(tmp_path: Path) -> Path:
    d = tmp_path / "mods"
    d.mkdir()
    (d / "zchild.py").write_text(CHILD)
    (d / "zsleeper.py").write_text(SLEEPER)
    (d / "zcrash.py").write_text("raise RuntimeError('boom in the child')\n")
    return d


@pytest.fixture
def env(mods: Path) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": f"{mods}{os.pathsep}{REPO}", "PYTHONUNBUFFERED": "1"}


@pytest.fixture
def server(env: dict[str, str]) -> Iterator[ForkServer]:
    s = ForkServer(sys.executable, env, preload=())
    s.wait_ready(30)
    yield s
    s.close()


def test_a_child_is_what_python_m_would_be(
    server: ForkServer, env: dict[str, str], tmp_path: Path, mods: Path
) -> None:
    proc = server.spawn("zchild", ["3", "x y"], {**env, "CHILD_VAR": "mine"}, str(tmp_path))
    assert proc.stdout is not None and proc.stderr is not None
    seen = json.loads(proc.stdout.readline())
    assert proc.stderr.read() == "to stderr\n"
    assert proc.wait(timeout=30) == 3 and proc.returncode == 3
    assert seen["argv"][1:] == ["3", "x y"] and seen["argv"][0].endswith("zchild.py")
    assert seen["cwd"] == str(tmp_path) and seen["env"] == "mine" and seen["main"] == "__main__"
    assert seen["path0"] == str(mods)  # `python -P`: PYTHONPATH first, never the working directory
    assert seen["sid"] and seen["ppid"] == server.proc.pid and seen["stdin"] == ""
    assert seen["sigint"] and seen["sigterm"]  # the server's own SIG_IGN is not inherited
    assert seen["comm"] == "zchild"  # `pgrep -x trainer` finds forked trainers
    assert proc.args == [sys.executable, "-P", "-m", "zchild", "3", "x y"]  # as Popen's: what it stands for


def test_an_uncaught_exception_is_exit_code_1_with_its_traceback(
    server: ForkServer, env: dict[str, str]
) -> None:
    proc = server.spawn("zcrash", [], env, os.getcwd())
    assert proc.stderr is not None
    assert "RuntimeError: boom in the child" in proc.stderr.read()
    assert proc.wait(timeout=30) == 1


def test_a_killed_child_stays_unreaped_until_wait(server: ForkServer, env: dict[str, str]) -> None:
    proc = server.spawn("zsleeper", [], env, os.getcwd())
    assert proc.stdout is not None
    grandchild = int(proc.stdout.readline())
    assert not exited(proc)
    os.kill(proc.pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while not exited(proc):
        assert time.monotonic() < deadline
        time.sleep(0.02)
    assert Path(f"/proc/{proc.pid}").exists()  # a zombie: its pid, the session's id, is not reused yet
    kill_leftovers(proc)  # what the provider does before it reaps: the rest of the session goes too
    assert proc.wait(timeout=10) == -signal.SIGKILL
    assert wait_gone(proc.pid) and wait_gone(grandchild)


def test_the_server_ignores_a_terminal_ctrl_c(server: ForkServer, env: dict[str, str]) -> None:
    """A Ctrl-C or a cancel's SIGTERM is the controller's to handle; the server's death would kill every
    trainer before it could save."""
    proc = server.spawn("zsleeper", [], env, os.getcwd())
    assert proc.stdout is not None
    grandchild = int(proc.stdout.readline())
    for sig in (signal.SIGINT, signal.SIGTERM):
        os.kill(server.proc.pid, sig)
    time.sleep(0.3)
    assert server.alive and not exited(proc)
    kill_leftovers(proc)
    proc.wait(timeout=10)
    assert wait_gone(grandchild)


def test_children_die_with_the_server_and_a_new_one_is_started(env: dict[str, str]) -> None:
    first = fork_server.server_for(sys.executable, {**env, "OMP_NUM_THREADS": "1"}, preload=())
    proc = first.spawn("zsleeper", [], env, os.getcwd())
    assert proc.stdout is not None
    grandchild = int(proc.stdout.readline())
    first.proc.kill()
    assert wait_gone(proc.pid), "a trainer outlived its fork server"
    assert proc.wait(timeout=10) == -signal.SIGKILL  # what the client reports for it
    with pytest.raises(ForkServerUnavailable):
        first.spawn("zchild", [], env, os.getcwd())
    second = fork_server.server_for(sys.executable, {**env, "OMP_NUM_THREADS": "1"}, preload=())
    assert second is not first and second.alive
    second.close()
    os.kill(grandchild, signal.SIGKILL)  # outside the killed server's reach (only a session kill gets it)


def test_a_server_that_never_starts_is_unavailable(tmp_path: Path, env: dict[str, str]) -> None:
    fake = tmp_path / "python"
    fake.write_text("#!/bin/sh\nexit 3\n")
    fake.chmod(0o755)
    s = ForkServer(str(fake), env, preload=())
    with pytest.raises(ForkServerUnavailable, match="exit code 3"):
        s.wait_ready(30)


def test_the_preload_fails_loudly_not_silently(env: dict[str, str]) -> None:
    s = ForkServer(sys.executable, env, preload=("no_such_module_here",))
    with pytest.raises(ForkServerUnavailable, match="exit code 1"):
        s.wait_ready(30)


@pytest.mark.parametrize(
    ("change", "same"),
    [
        ({"SPOTRUN_FLOW_RUN_ID": "other", "AWS_PROFILE": "x"}, True),  # the child's own, set after the fork
        ({"OMP_NUM_THREADS": "7"}, False),  # read by OpenMP when torch loads
        ({"OMP_WAIT_POLICY": "ACTIVE"}, False),
        ({"PYTHONHASHSEED": "1"}, False),
        ({"PYTHONPATH": "/elsewhere"}, False),
        ({"LD_PRELOAD": "libjemalloc.so"}, False),
        ({"TORCH_LOGS": "dynamo"}, False),
        ({"LC_ALL": "C"}, False),
    ],
)
def test_load_key_separates_what_start_up_reads(change: dict[str, str], same: bool) -> None:
    base = {"PATH": "/usr/bin", "PYTHONPATH": "/repo", "OMP_NUM_THREADS": "2"}
    assert (load_key("/py", base) == load_key("/py", {**base, **change})) is same
    assert load_key("/py", base) != load_key("/other/py", base)


def test_the_default_preload_leaves_no_cuda_and_one_thread_to_fork_from(env: dict[str, str]) -> None:
    """What the server imports must not start CUDA (a forked child could not use it) nor Python threads
    (a lock held by one at the fork would never be released in the child)."""
    code = (
        "import importlib, json, threading, torch\n"
        f"for m in {list(fork_server.PRELOAD)!r}: importlib.import_module(m)\n"
        "print(json.dumps([torch.cuda.is_initialized(), threading.active_count()]))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert json.loads(out.stdout.splitlines()[-1]) == [False, 1]


def test_a_server_closed_before_it_serves_exits(env: dict[str, str]) -> None:
    """Its `ready` finds the client gone: with no client left it exits (it once served nobody forever,
    and close() waited 10 s for it)."""
    s = ForkServer(sys.executable, env, preload=())
    s.close()
    assert s.proc.returncode == 0
