"""Trainer pools (tasks/providers/local/pool.py, trainer/launch/pool.py): one fork server shared by the
controllers of one host that name a pool. Real processes and sockets, no mocks; the servers preload
nothing (fork_server.PRELOAD is emptied), so they start in milliseconds."""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from spotrun import pool_cmd
from spotrun.tasks.providers.local import LocalProvider, LocalProviderConfig, fork_server, pool
from spotrun.tasks.providers.local.pool import Place
from spotrun.trainer.launch.pool import peer_refusal, peer_uid
from tests.procs import wait_gone

REPO = Path(__file__).resolve().parents[2]

CHILD = "import json, os; print(json.dumps({'ppid': os.getppid(), 'pid': os.getpid()}), flush=True)\n"
SLEEPER = "import os, time; print(os.getpid(), flush=True); time.sleep(120)\n"

# A controller in its own process: a LocalProvider naming the pool starts a child and a sleeper, prints
# both, and exits at once (os._exit: no cleanup, as a controller that is killed).
CONTROLLER = textwrap.dedent("""
    import json, os, sys
    from pathlib import Path
    from spotrun.tasks.providers.local import LocalProvider, LocalProviderConfig, fork_server
    fork_server.PRELOAD = ()
    home, mods, pause = Path(sys.argv[1]), Path(sys.argv[2]), float(sys.argv[3])
    provider = LocalProvider(LocalProviderConfig(pool="shared", pool_idle_s=30), home=home)
    import time; time.sleep(max(0, pause - time.time()))  # two controllers start at one moment
    env = {**os.environ, "PYTHONPATH": f"{mods}{os.pathsep}{os.environ['PYTHONPATH']}"}
    child = provider._start([sys.executable], "zchild", [], env=env, cwd=mods)
    sleeper = provider._start([sys.executable], "zsleeper", [], env=env, cwd=mods)
    seen = {"child": json.loads(child.stdout.readline()), "sleeper": int(sleeper.stdout.readline())}
    print(json.dumps(seen))
    sys.stdout.flush()
    os._exit(0)
""")


@pytest.fixture
def mods(tmp_path: Path) -> Path:
    d = tmp_path / "mods"
    d.mkdir()
    (d / "zchild.py").write_text(CHILD)
    (d / "zsleeper.py").write_text(SLEEPER)
    (d / "zsetenv.py").write_text("import os; os.environ['TORCHINDUCTOR_CACHE_DIR'] = '/tmp/set-by-import'\n")
    return d


@pytest.fixture
def env(mods: Path) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": f"{mods}{os.pathsep}{REPO}", "PYTHONUNBUFFERED": "1"}


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A SPOTRUN_HOME whose pools' servers are stopped after the test; the path is long enough that
    the socket is bound through its directory's fd."""
    monkeypatch.setattr(fork_server, "PRELOAD", ())
    h = tmp_path / ("home-" + "x" * 60)
    yield h
    for place in [p for p in pool._pools if p.directory == pool.pools_dir(h)]:
        pool._pools.pop(place).close()
        pool.stop(place)


def spawn_child(
    place: Place, env: dict[str, str], mods: Path, idle_s: float = 30, preload: tuple[str, ...] = ()
) -> dict[str, int]:
    proc = pool.spawn(place, sys.executable, "zchild", [], env=env, cwd=mods, idle_s=idle_s, preload=preload)
    assert proc.stdout is not None
    seen: dict[str, int] = json.loads(proc.stdout.readline())
    proc.wait(timeout=10)
    return seen


def test_two_controllers_share_one_server_that_outlives_them(
    home: Path, mods: Path, env: dict[str, str]
) -> None:
    """Two controllers that start at once get one server (the lock file); it outlives both."""
    at = str(time.time() + 1.0)  # both have imported by then
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", CONTROLLER, str(home), str(mods), at],
            env={**os.environ, "PYTHONPATH": str(REPO), "SPOTRUN_SIGNING_SECRET_FOR_TEST": "job-1"},
            stdout=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    seen = [json.loads(p.communicate(timeout=60)[0].splitlines()[-1]) for p in procs]
    assert [p.returncode for p in procs] == [0, 0]
    server = seen[0]["child"]["ppid"]
    assert seen[1]["child"]["ppid"] == server
    for s in seen:
        assert wait_gone(s["sleeper"]), "a controller that died left its trainer running"
    environ = Path(f"/proc/{server}/environ").read_bytes()
    assert b"SPOTRUN_SIGNING_SECRET_FOR_TEST" not in environ  # the starting job's own, not the server's
    assert (pool.pools_dir(home).stat().st_mode & 0o777) == 0o700
    assert (pool.Place(pool.pools_dir(home), "shared").socket.stat().st_mode & 0o777) == 0o600

    provider = LocalProvider(LocalProviderConfig(pool="shared"), home=home)
    proc = provider._start([sys.executable], "zchild", [], env=env, cwd=mods)
    assert proc.stdout is not None
    assert json.loads(proc.stdout.readline())["ppid"] == server  # the first controller's server, alive
    proc.wait(timeout=10)
    assert [(r.name, r.pid) for r in pool.running(pool.pools_dir(home))] == [("shared", server)]


def test_a_killed_server_and_its_stale_socket_are_replaced(
    home: Path, mods: Path, env: dict[str, str]
) -> None:
    place = Place(pool.pools_dir(home), "p1")
    first = spawn_child(place, env, mods)["ppid"]
    os.kill(first, signal.SIGKILL)
    assert wait_gone(first) and place.socket.exists()  # a stale socket: nobody listens on it
    deadline = time.monotonic() + 10
    while pool._pools[place].alive:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    second = spawn_child(place, env, mods)["ppid"]
    assert second != first and not wait_gone(second, timeout=0)
    assert [(r.name, r.pid) for r in pool.running(place.directory)] == [("p1", second)]


def test_another_load_time_environment_gets_a_private_server(
    home: Path, mods: Path, env: dict[str, str], caplog: pytest.LogCaptureFixture
) -> None:
    place = Place(pool.pools_dir(home), "p2")
    shared = spawn_child(place, env, mods)["ppid"]
    caplog.set_level(logging.INFO, logger=pool.__name__)
    other = {**env, "OMP_NUM_THREADS": "7"}
    private = spawn_child(place, other, mods)["ppid"]
    assert private != shared
    assert private == fork_server.server_for(sys.executable, other, ()).pid
    assert [r.getMessage() for r in caplog.records if "another load-time" in r.getMessage()] == [
        "trainer pool p2 serves another load-time environment (OMP_NUM_THREADS differ); this job's "
        "trainers use a private fork server"
    ]
    fork_server.server_for(sys.executable, other, ()).close()


def test_the_key_is_the_environment_given_before_the_imports_changed_it(
    home: Path, mods: Path, env: dict[str, str]
) -> None:
    """torch._dynamo's import sets TORCHINDUCTOR_CACHE_DIR in the server: a key read after the preload
    matched no job, and every job got a private server."""
    place = Place(pool.pools_dir(home), "p5")
    shared = spawn_child(place, env, mods, preload=("zsetenv",))["ppid"]
    assert shared == pool._pools[place].pid
    assert spawn_child(place, env, mods)["ppid"] == shared


def test_an_idle_server_ends_and_removes_its_socket(home: Path, mods: Path, env: dict[str, str]) -> None:
    place = Place(pool.pools_dir(home), "p3")
    server = spawn_child(place, env, mods, idle_s=0.3)["ppid"]
    assert wait_gone(server, timeout=5)
    assert not place.socket.exists()
    assert pool.running(place.directory) == []


def test_stop_ends_the_server_once_its_trainers_have(
    home: Path,
    mods: Path,
    env: dict[str, str],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """`spotrun pool list` and `spotrun pool stop NAME`."""
    place = Place(pool.pools_dir(home), "p4")
    sleeper = pool.spawn(place, sys.executable, "zsleeper", [], env=env, cwd=mods, idle_s=30)
    server = pool._pools[place].pid
    monkeypatch.setenv("SPOTRUN_HOME", str(home))
    assert pool_cmd.cmd_list(argparse.Namespace()) == 0
    assert capsys.readouterr().out == f"p4: pid {server}, 1 trainer(s) running, {sys.executable}\n"
    assert pool_cmd.cmd_stop(argparse.Namespace(name="p4")) == 0
    assert f"(pid {server}) takes no more requests" in capsys.readouterr().out
    assert not place.socket.exists() and not wait_gone(server, timeout=0.3)  # a trainer still runs
    os.kill(sleeper.pid, signal.SIGKILL)
    sleeper.wait(timeout=10)
    assert wait_gone(server, timeout=5)
    assert pool.stop(place) is None


def test_a_peer_of_this_uid_is_served_and_others_are_refused() -> None:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    with a, b:
        assert peer_uid(a) == os.getuid()
    assert peer_refusal(os.getuid(), os.getuid()) is None
    assert peer_refusal(1001, 1000) == (
        "this trainer pool serves uid 1000 only (the caller is uid 1001); start your own pool"
    )
