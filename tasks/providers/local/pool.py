"""Trainer pools (`provider.pool: NAME`): one fork server shared by every controller of this user on the
host that names the pool, so that a job's first trainer does not pay the imports a private server
pays (trainer/launch/pool.py is the server's side).

A flow run's controller is one process; with a private server (fork_server.py) each pays torch's and
dynamo's imports for its first attempt. A pool's server is started by the first controller that needs
it and outlives it, until `pool_idle_s` passes with no request and no trainer of its own. Jobs' specs
may differ (the recipe is imported per trainer); their load-time environment may not (fork_server.py):
a job whose load key differs from the pool's uses a private server, and says so in one line.

Files, in `$SPOTRUN_HOME/pools/` (0700): `NAME.sock` (0600; the server also refuses a peer of another
uid), `NAME.lock` (held while a controller connects or starts the server, and by the server while it
ends, so two starters end with one server) and `NAME.log` (the server's stderr). A socket nobody
answers on is stale: the next controller replaces it.

Measured (bench/pool.py, 2-core VM shared with other work, load average 2.6): a second job's first
trainer, provision to its `started` record, 0.10 s from a warm pool against 4.48 s with a private
server started cold (medians of 3; pool_ratio 0.02).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import subprocess
import threading
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from spotrun.tasks.providers.local import fork_server
from spotrun.tasks.providers.local.fork_server import (
    ForkedProcess,
    ForkServerUnavailable,
    ServerConnection,
    load_key,
)
from spotrun.trainer.interpreter import python_m
from spotrun.trainer.launch.pool import peer_uid
from spotrun.trainer.launch.zygote import LOAD_TIME_PREFIXES, MAX_PACKET, LoadKey, send
from spotrun.trainer.storage.locks import LockTimeout, flock_within

log = logging.getLogger(__name__)

LOCK_WAIT_S = 30.0  # a starter holds the lock for a bind and a process start: well under a second
START_TIMEOUT_S = 30.0  # the server's first process exits once it has forked the server
BACKLOG = 64
MAX_SUN_PATH = 100  # sockaddr_un holds 108 bytes; a longer path is bound through its directory's fd


@dataclass(frozen=True)
class Place:
    """Where a pool's files are: `directory` ($SPOTRUN_HOME/pools) and the pool's name."""

    directory: Path
    name: str

    @property
    def socket(self) -> Path:
        return self.directory / f"{self.name}.sock"

    @property
    def lock(self) -> Path:
        return self.directory / f"{self.name}.lock"

    @property
    def log(self) -> Path:
        return self.directory / f"{self.name}.log"


def pools_dir(home: Path) -> Path:
    """The pools' directory under SPOTRUN_HOME."""
    return home / "pools"


def connect(
    place: Place,
    python: str,
    env: Mapping[str, str],
    *,
    idle_s: float,
    preload: Sequence[str] | None = None,
) -> ServerConnection:
    """A connection to the pool's server, started (with `env`, serving `python`, importing `preload`,
    default fork_server.PRELOAD) if none answers; ForkServerUnavailable when neither works."""
    try:
        _private_dir(place.directory)
        with flock_within(place.lock, LOCK_WAIT_S, f"trainer pool {place.name}"):
            sock = _connect(place.socket)
            if sock is None:
                _start(
                    place,
                    python,
                    env,
                    idle_s=idle_s,
                    preload=fork_server.PRELOAD if preload is None else preload,
                )
                sock = _connect(place.socket)
    except (OSError, LockTimeout, subprocess.SubprocessError) as e:
        raise ForkServerUnavailable(f"trainer pool {place.name}: {e}") from e
    if sock is None:
        raise ForkServerUnavailable(f"trainer pool {place.name}: its server did not start (see {place.log})")
    return ServerConnection(sock, python)


_pools: dict[Place, ServerConnection] = {}
_told: set[tuple[Place, LoadKey]] = set()
_pools_lock = threading.Lock()


def spawn(
    place: Place,
    python: str,
    module: str,
    argv: Sequence[str],
    *,
    env: Mapping[str, str],
    cwd: str | os.PathLike[str],
    idle_s: float,
    preload: Sequence[str] | None = None,
) -> ForkedProcess:
    """`python -P -m module *argv` in `cwd`, forked from the pool's server; from this process's private
    server when the pool's load-time environment is another."""
    with _pools_lock:
        conn = _pools.get(place)
        if conn is None or not conn.alive:
            conn = _pools[place] = connect(place, python, env, idle_s=idle_s, preload=preload)
    conn.wait_ready()
    ours, theirs = load_key(python, env), _key(conn.hello.get("key"))
    if ours == theirs:
        return conn.spawn(module, argv, env, os.fspath(cwd))
    if (place, ours) not in _told:
        _told.add((place, ours))
        log.warning(
            "trainer pool %s serves another load-time environment (%s differ); this job's trainers "
            "use a private fork server",
            place.name,
            differences(ours, theirs),
        )
    return fork_server.spawn(python, module, argv, env=env, cwd=cwd, preload=preload)


def differences(ours: LoadKey, theirs: LoadKey | None) -> str:
    """What differs between two load keys, by name (values may be long paths)."""
    if theirs is None:
        return "an unreadable key"
    names = ["the interpreter"] if ours[0] != theirs[0] else []
    a, b = dict(ours[1]), dict(theirs[1])
    names += sorted(k for k in a.keys() | b.keys() if a.get(k) != b.get(k))
    return ", ".join(names)


@dataclass(frozen=True)
class Running:
    """A pool as `spotrun pool list` shows it."""

    name: str
    pid: int | None  # None: a stale socket nobody answers on
    trainers: int = 0
    python: str = ""


def running(directory: Path, timeout_s: float = 5.0) -> list[Running]:
    """Every pool with a socket in `directory`, asked for its pid and trainers (None: stale)."""
    found = []
    for path in sorted(directory.glob("*.sock")) if directory.is_dir() else []:
        hello = _hello(path, timeout_s)
        if hello is None:
            found.append(Running(path.stem, None))
        else:
            key = _key(hello.get("key"))
            python = key[0] if key is not None else ""
            found.append(Running(path.stem, int(hello["pid"]), int(hello.get("trainers", 0)), python))
    return found


def stop(place: Place, timeout_s: float = 5.0) -> int | None:
    """Ask the pool's server to stop taking requests and end once its trainers have: its pid, or None
    when no server answers (a stale socket file is removed)."""
    if not place.socket.exists():
        return None
    with flock_within(place.lock, LOCK_WAIT_S, f"trainer pool {place.name}"):
        sock = _connect(place.socket)
        if sock is None:
            place.socket.unlink(missing_ok=True)
            return None
    with sock:
        sock.settimeout(timeout_s)
        hello = json.loads(sock.recv(MAX_PACKET))
        send(sock, {"op": "stop"})
        sock.recv(MAX_PACKET)  # "stopping": it has closed its socket (under the lock we just released)
        return int(hello["pid"])


def server_env(env: Mapping[str, str]) -> dict[str, str]:
    """What a pool's server is started with: the load-time variables and PATH. Not the rest of the job
    that starts it (its flow run's id, a signing key, credentials): the server outlives that job and
    serves others, whose trainers get their own environment at the fork."""
    return {k: v for k, v in env.items() if k.startswith(LOAD_TIME_PREFIXES) or k == "PATH"}


def _hello(path: Path, timeout_s: float) -> dict[str, Any] | None:
    try:
        sock = _connect(path)
        if sock is None:
            return None
        with sock:
            sock.settimeout(timeout_s)
            hello: dict[str, Any] = json.loads(sock.recv(MAX_PACKET))
            return hello if hello.get("op") == "ready" else None
    except (OSError, ValueError):
        return None


def _key(raw: Any) -> LoadKey | None:
    """A load key as JSON carried it (lists), as a tuple again."""
    try:
        python, pairs = raw
        return str(python), tuple((str(k), str(v)) for k, v in pairs)
    except (TypeError, ValueError):
        return None


def _private_dir(directory: Path) -> None:
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = directory.stat()
    if st.st_uid != os.getuid():
        raise PermissionError(f"{directory} belongs to uid {st.st_uid}, not to this user")
    if st.st_mode & 0o077:
        directory.chmod(0o700)


@contextlib.contextmanager
def _address(path: Path) -> Iterator[str]:
    """`path` as a socket address: through its directory's fd (Linux) when it is too long for one."""
    if len(os.fsencode(path)) < MAX_SUN_PATH:
        yield str(path)
        return
    fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        yield f"/proc/self/fd/{fd}/{path.name}"
    finally:
        os.close(fd)


def _connect(path: Path) -> socket.socket | None:
    """A connection to the server at `path`, or None when nobody listens there (no file, or stale)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        with _address(path) as address:
            sock.connect(address)
    except (FileNotFoundError, ConnectionRefusedError):
        sock.close()
        return None
    if peer_uid(sock) != os.getuid():  # the directory is ours and 0700: only if someone changed that
        sock.close()
        raise PermissionError(f"{path} is served by another user")
    return sock


def _start(
    place: Place, python: str, env: Mapping[str, str], *, idle_s: float, preload: Sequence[str]
) -> None:
    """Bind the pool's socket (replacing a stale one) and start a server on it; called under the lock."""
    place.socket.unlink(missing_ok=True)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        with _address(place.socket) as address:
            listener.bind(address)
        os.chmod(place.socket, 0o600)
        listener.listen(BACKLOG)
        cmd = python_m(
            "spotrun.trainer.launch.zygote",
            "--pool",
            str(listener.fileno()),
            str(place.socket),
            str(place.lock),
            f"{idle_s:g}",
            python,
            ",".join(preload),
            python=python,
        )
        logfd = os.open(place.log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        try:
            first = subprocess.Popen(
                cmd,
                pass_fds=(listener.fileno(),),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=logfd,
                env=server_env(env),
                start_new_session=True,  # no terminal's Ctrl-C, and no parent-death signal: it outlives us
            )
        finally:
            os.close(logfd)
        first.wait(timeout=START_TIMEOUT_S)
    finally:
        listener.close()
    log.info("started trainer pool %s (socket %s, ends after %g s idle)", place.name, place.socket, idle_s)
