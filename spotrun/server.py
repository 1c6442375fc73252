"""A Prefect API to run flows against: the one PREFECT_API_URL names, the background server
`spotrun server start` keeps under SPOTRUN_HOME, or a local server started for one command.

`PrefectServer` runs `prefect server start` on a loopback port, in its own process group, with
SQLite under its PREFECT_HOME or on a PostgreSQL database a team shares (spotrun/prefect_db.py); it
is ready when /api/health answers (7-14 s on a fresh database on 2 cores, 3-5 s on an existing one)
and stops on SIGTERM to the group. The background server is the same process started without a
parent-death signal, recorded in `<home>/prefect/server.json`; every command finds it there and
checks it (the pid is a Prefect server, /api/health answers) before use.

Every server is private to its home: it answers only requests carrying the auth string in
`<server home>/auth_string` (0600, made on first start), admits browsers only from its own origin
(CORS) and wants a CSRF token for every change; the key that encrypts its Secret blocks comes from
`<server home>/encryption_key` (0600), not from its database. Clients spotrun starts get the auth
string through PREFECT_API_AUTH_STRING (`client_env`).
"""

from __future__ import annotations

import base64
import contextlib
import ipaddress
import json
import os
import secrets
import signal
import socket
import sqlite3
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from spotrun import prefect_db
from spotrun.trainer.errors import ConfigError, SpotrunError
from spotrun.trainer.storage.locks import flock_within


class ServerStartError(SpotrunError):
    """The local Prefect server did not come up; the message names its log."""


class BindRefused(ConfigError):
    """A bind off loopback without TLS in front: clients would send the auth string in clear."""


DEFAULT_PORT = 4200  # Prefect's own default: the UI address a user already knows, when it is free
STATE_FILE = "server.json"  # in the background server's PREFECT_HOME: pid, API URL, start time
LOCK_FILE = "server.lock"  # held while one command checks for, or starts, the background server
LOCK_WAIT_S = 150.0  # longer than one start (90 s at most): a holder past it is stuck, not busy
AUTH_FILE = "auth_string"  # in the server's PREFECT_HOME, 0600: `spotrun:<random>`, sent as Basic auth
KEY_FILE = "encryption_key"  # in the server's PREFECT_HOME, 0600: the Fernet key of its Secret blocks
DATABASE = "prefect.db"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def is_loopback(host: str) -> bool:
    """Whether `host` names this machine only (127.0.0.0/8, ::1, localhost); a hostname is not."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_bind(host: str, public_url: str | None) -> None:
    """Refuse a bind off loopback unless a TLS proxy serves the API (`public_url`, https): clients
    send the auth string with every request, in clear over plain http."""
    if is_loopback(host):
        return
    if public_url and public_url.startswith("https://"):
        return
    raise BindRefused(
        f"--host {host} is not a loopback address: clients would send the auth string over the network "
        "in clear; bind 127.0.0.1, or put a TLS proxy in front and give its address with "
        "--public-url https://HOST[:PORT]"
    )


def private_file(path: Path, make: Callable[[], str]) -> str:
    """The secret in `path`; on first use `make()`'s, written 0600. Two starts at once agree (the
    first link wins); a file that others can read is made 0600 again."""
    try:
        text = path.read_text().strip()
    except FileNotFoundError:
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(make() + "\n")
            f.flush()
            os.fsync(f.fileno())
        try:
            os.link(tmp, path)
        except FileExistsError:
            pass  # another start made it first: use theirs
        finally:
            tmp.unlink()
        text = path.read_text().strip()
    if not text:
        raise ServerStartError(f"{path} is empty: delete it and start again (a new one is made)")
    if path.stat().st_mode & 0o077:
        path.chmod(0o600)
    return text


def auth_string(server_home: Path) -> str:
    """The server's auth string (`spotrun:<random>`), made on first use."""
    return private_file(server_home / AUTH_FILE, lambda: f"spotrun:{secrets.token_urlsafe(32)}")


def encryption_key(server_home: Path) -> str:
    """The Fernet key of the server's Secret blocks, made on first use: Prefect's own key copied out
    of an existing prefect.db (and removed from it), else a new one. Without the copy, every Secret
    block saved before (a Slack webhook) would stop decrypting."""
    path = server_home / KEY_FILE
    if path.exists():
        return private_file(path, str)
    db = server_home / DATABASE
    key = private_file(path, lambda: _key_in_database(db) or _new_fernet_key())
    _forget_key_in_database(db, key)
    return key


def _new_fernet_key() -> str:
    return base64.urlsafe_b64encode(secrets.token_bytes(32)).decode()


def _key_in_database(db: Path) -> str | None:
    """The key Prefect generated into `db` (its `configuration` table), if it has one."""
    if not db.is_file():
        return None
    try:
        with contextlib.closing(sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=30)) as con:
            row = con.execute("SELECT value FROM configuration WHERE key = 'ENCRYPTION_KEY'").fetchone()
    except sqlite3.Error:  # no such table (never migrated): no Secret block was ever saved in it
        return None
    if row is None:
        return None
    value = json.loads(row[0]) if isinstance(row[0], str | bytes) else row[0]
    return str(value["fernet_key"])


def _forget_key_in_database(db: Path, key: str) -> None:
    """Delete the key from `db` once the key file holds the same key: it lives in the file alone."""
    if _key_in_database(db) != key:
        return
    with contextlib.closing(sqlite3.connect(db, timeout=30)) as con, con:
        con.execute("DELETE FROM configuration WHERE key = 'ENCRYPTION_KEY'")


class PrefectServer:
    """`prefect server start` on 127.0.0.1 (or `host`, behind a TLS proxy at `public_url`), SQLite
    under `home` or the `database` URL (PostgreSQL), private (auth string, CORS, CSRF, key file); its
    output goes to home/server.log."""

    def __init__(
        self,
        home: Path,
        port: int | None = None,
        die_with_parent: bool = True,
        *,
        host: str = "127.0.0.1",
        public_url: str | None = None,
        database: str | None = None,
    ) -> None:
        check_bind(host, public_url)
        self.database = prefect_db.server_database_url(database) if database else None
        self.home, self.port = home, port or free_port()
        self.host, self.public_url = host, public_url.rstrip("/") if public_url else None
        self.die_with_parent = die_with_parent  # False: it may outlive this process (--keep-server)
        local = "127.0.0.1" if host in ("0.0.0.0", "::") or is_loopback(host) else host
        self.api_url = f"http://{local}:{self.port}/api"  # what clients on this host use
        self.proc: subprocess.Popen[bytes] | None = None
        self.log = home / "server.log"

    @property
    def auth(self) -> str:
        self.home.mkdir(parents=True, exist_ok=True)
        return auth_string(self.home)

    def origins(self) -> list[str]:
        """The browser origins the UI is served from: the only ones CORS admits."""
        if self.public_url is not None:
            return [self.public_url]
        return [f"http://127.0.0.1:{self.port}", f"http://localhost:{self.port}"]

    def client_env(self) -> dict[str, str]:
        """What a Prefect client needs to use this server (a child process inherits it)."""
        return {"PREFECT_API_URL": self.api_url, "PREFECT_API_AUTH_STRING": self.auth}

    def env(self) -> dict[str, str]:
        ui_api = f"{self.public_url}/api" if self.public_url else self.api_url
        return {
            "PREFECT_HOME": str(self.home),
            **self.client_env(),
            # The UI asks this for its API; the default (port 4200) is wrong on a free port.
            "PREFECT_SERVER_UI_API_URL": ui_api,
            "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
            "DO_NOT_TRACK": "1",  # nor the client's telemetry (read when prefect is first imported)
            "PREFECT_SERVER_LOGGING_LEVEL": "WARNING",
        }

    def server_env(self) -> dict[str, str]:
        """env() plus what only the server reads: its auth string, CORS, CSRF, its secrets' key and,
        when given, its database."""
        db = {prefect_db.PREFECT_SETTING: self.database} if self.database else {}
        return {
            **self.env(),
            "PREFECT_SERVER_API_AUTH_STRING": self.auth,
            "PREFECT_SERVER_CORS_ALLOWED_ORIGINS": ",".join(self.origins()),
            "PREFECT_SERVER_CSRF_PROTECTION_ENABLED": "true",
            "PREFECT_SERVER_ENCRYPTION_KEY": encryption_key(self.home),
            **db,
        }

    @property
    def database_shown(self) -> str:
        """Where its runs are kept, password hidden: the PostgreSQL URL, or the SQLite file."""
        return prefect_db.shown(self.database) if self.database else str(self.home / DATABASE)

    @contextmanager
    def clients(self) -> Iterator[None]:
        """Prefect clients in this process, and the processes it starts, use this server."""
        with using_api(self.api_url, self.auth):
            yield

    def spawn(self) -> subprocess.Popen[bytes]:
        """Start `prefect server start` (not waiting for it). Unless told otherwise it dies with this
        process (parent-death signal): a SIGKILLed demo or test leaves no server holding the database."""
        from spotrun.tasks.providers.processes import die_with_parent, on_spawner_thread

        self.home.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "prefect", "server", "start", "--host", self.host]
        cmd += ["--port", str(self.port)]
        env = {**os.environ, **self.server_env()}
        env.pop("PREFECT_API_URL", None)  # the server itself must not talk to another server
        if self.database:  # the legacy alias would win over the setting's own name
            env.pop("PREFECT_API_DATABASE_CONNECTION_URL", None)
        preexec = die_with_parent() if self.die_with_parent else None

        def popen() -> subprocess.Popen[bytes]:
            with open(self.log, "wb") as out:
                return subprocess.Popen(
                    cmd,
                    env=env,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                    preexec_fn=preexec,
                )

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


def healthy(api_url: str, timeout_s: float = 2.0) -> bool:
    """Whether the Prefect API at `api_url` answers its health check."""
    try:
        with urllib.request.urlopen(f"{api_url}/health", timeout=timeout_s) as r:
            return bool(r.status == 200)
    except OSError:
        return False


def port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


@dataclass(frozen=True)
class Background:
    """The background server as its state file records it."""

    pid: int
    api_url: str
    started_at: float
    log: str
    public_url: str | None = None  # the TLS proxy's address, when it listens off loopback
    database: str = ""  # where it keeps its runs, password hidden ('' in a state file from before)

    @property
    def ui_url(self) -> str:
        return self.public_url or self.api_url.removesuffix("/api")


def server_home(home: Path) -> Path:
    """The background server's PREFECT_HOME (its SQLite database, log and state file)."""
    return home / "prefect"


def _read_state(home: Path) -> Background | None:
    try:
        d = json.loads((server_home(home) / STATE_FILE).read_text())
        public = str(d["public_url"]) if d.get("public_url") else None
        return Background(
            int(d["pid"]),
            str(d["api_url"]),
            float(d["started_at"]),
            log=str(d["log"]),
            public_url=public,
            database=str(d.get("database") or ""),
        )
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _is_prefect_server(pid: int) -> bool:
    """The pid is alive and runs a Prefect server (not a reused pid, not a zombie)."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z" and b"prefect" in cmdline and b"server" in cmdline


def running_server(home: Path) -> Background | None:
    """The background server under `home` when its process runs and its API answers, else None."""
    state = _read_state(home)
    if state is None or not _is_prefect_server(state.pid):
        return None
    return state if healthy(state.api_url) else None


@contextmanager
def _server_lock(home: Path) -> Iterator[None]:
    """One command at a time checks for or starts the background server (two would share one SQLite);
    LockTimeout after LOCK_WAIT_S."""
    server_home(home).mkdir(parents=True, exist_ok=True)
    with flock_within(server_home(home) / LOCK_FILE, LOCK_WAIT_S, "the background Prefect server"):
        yield


def start_background(
    home: Path,
    port: int | None = None,
    timeout_s: float = 90,
    *,
    host: str = "127.0.0.1",
    public_url: str | None = None,
    database: str | None = None,
) -> tuple[Background, bool]:
    """The background server, started now unless it already runs; (server, started now). `port`: None
    takes 4200 when free, else a free one; 0 always a free one; `database`: a PostgreSQL URL (None:
    SQLite under home). BindRefused for `host` off loopback without an https `public_url`;
    ServerStartError if it does not come up or the port is taken."""
    check_bind(host, public_url)
    with _server_lock(home):
        found = running_server(home)
        if found is not None:
            return found, False
        state = _read_state(home)
        if state is not None and _is_prefect_server(state.pid):
            raise ServerStartError(
                f"the background Prefect server (pid {state.pid}) runs but {state.api_url}/health does not "
                f"answer; see {state.log}, or stop it with `spotrun server stop`"
            )
        if port and not port_free(port):
            raise ServerStartError(f"port {port} on 127.0.0.1 is in use; pick another with --port")
        chosen = port or (DEFAULT_PORT if port is None and port_free(DEFAULT_PORT) else free_port())
        server = PrefectServer(
            server_home(home), chosen, False, host=host, public_url=public_url, database=database
        ).start(timeout_s)
        assert server.proc is not None
        bg = Background(
            server.proc.pid,
            server.api_url,
            time.time(),
            log=str(server.log),
            public_url=server.public_url,
            database=server.database_shown,
        )
        tmp = server_home(home) / f"{STATE_FILE}.tmp"
        tmp.write_text(json.dumps(bg.__dict__) + "\n")
        os.replace(tmp, server_home(home) / STATE_FILE)
        return bg, True


def stop_background(home: Path, timeout_s: float = 15) -> Background | None:
    """Stop the background server (SIGTERM to its group, SIGKILL after `timeout_s`); the stopped one, or
    None when none ran. Its database and log stay: the next start keeps the flow-run history."""
    with _server_lock(home):
        state = _read_state(home)
        (server_home(home) / STATE_FILE).unlink(missing_ok=True)
        if state is None or not _is_prefect_server(state.pid):
            return None
        _signal_group(state.pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        while _is_prefect_server(state.pid) and time.monotonic() < deadline:
            time.sleep(0.2)
        if _is_prefect_server(state.pid):
            _signal_group(state.pid, signal.SIGKILL)
        return state


def _signal_group(pid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, sig)  # the server leads its own session: its uvicorn workers go with it


@dataclass(frozen=True)
class PrefectApi:
    """The API flows run against. `source`: PREFECT_API_URL (env), the background server, or a server
    started for this command alone (temporary: `server` is set, and its links die with it)."""

    url: str
    server: PrefectServer | None
    source: Literal["env", "background", "temporary"] = "temporary"
    started: bool = False  # the background server was started by this command

    @property
    def ui_url(self) -> str:
        from prefect.settings import PREFECT_UI_URL

        return str(PREFECT_UI_URL.value() or self.url.removesuffix("/api"))

    def flow_run_url(self, flow_run_id: object) -> str:
        return f"{self.ui_url}/runs/flow-run/{flow_run_id}"


def configured_database(environ: Mapping[str, str] | None = None) -> str | None:
    """The Prefect server's database from SPOTRUN_PREFECT_DATABASE_URL (None: SQLite under the home)."""
    url = (os.environ if environ is None else environ).get(prefect_db.ENV, "").strip()
    return url or None


def choose_api(
    home: Path,
    *,
    use_env: bool,
    background: Literal["no", "reuse", "start"],
    database: str | None = None,
) -> PrefectApi:
    """PREFECT_API_URL (when `use_env` and set); else the background server when it runs (`reuse`),
    or started now (`start`, on `database` when given); else a temporary server (the caller stops it)."""
    url = os.environ.get("PREFECT_API_URL", "").strip() if use_env else ""
    if url:
        return PrefectApi(url, None, "env")
    if background == "start":
        bg, started = start_background(home, database=database)
        return PrefectApi(bg.api_url, None, "background", started)
    if background == "reuse":
        with _server_lock(home):
            found = running_server(home)
        if found is not None:
            return PrefectApi(found.api_url, None, "background")
    return PrefectApi("", None)


@contextmanager
def prefect_api(
    home: Path,
    *,
    use_env: bool = True,
    keep: bool = False,
    background: Literal["no", "reuse", "start"] = "reuse",
    temporary: bool = True,
    database: str | None = None,
) -> Iterator[PrefectApi]:
    """The server PREFECT_API_URL names (when `use_env` and it is set), as is; else the background server
    as `background` says (choose_api); otherwise (when `temporary`) a local server under home/"prefect",
    started now and stopped on exit unless `keep`. The body runs with PREFECT_API_URL pointing at it
    (trainer subprocesses inherit it through the environment too). Not `temporary` and neither found:
    the body runs with `api.url` empty and the settings as they are (a Prefect profile's URL, or none).
    A server started here keeps its runs in `database` (None: SPOTRUN_PREFECT_DATABASE_URL when
    `use_env`, else SQLite under the home)."""
    if database is None and use_env:
        database = configured_database()
    api = choose_api(home, use_env=use_env, background=background, database=database)
    if not api.url and not temporary:
        yield api
        return
    server = None
    if not api.url:
        server = PrefectServer(server_home(home), die_with_parent=not keep, database=database).start()
        api = PrefectApi(server.api_url, server)
    # PREFECT_API_URL's server: the auth string the environment (or profile) gives, as is; ours: its file
    auth = None if api.source == "env" else auth_string(server_home(home))
    try:
        with using_api(api.url, auth, server.env() if server is not None else {}):
            try:
                yield api
            finally:
                flush_to_api()
    finally:
        if server is not None and not keep:
            server.stop()


@contextmanager
def using_api(url: str, auth: str | None, extra_env: dict[str, str] | None = None) -> Iterator[None]:
    """Prefect clients in this process, and the processes it starts (they inherit the environment),
    talk to `url`, sending `auth` (None: whatever auth string the settings already hold)."""
    from prefect.settings import PREFECT_API_AUTH_STRING, PREFECT_API_URL, temporary_settings

    env = {**(extra_env or {}), "PREFECT_API_URL": url}
    updates: dict[Any, Any] = {PREFECT_API_URL: url}
    if auth is not None:
        env["PREFECT_API_AUTH_STRING"] = auth
        updates[PREFECT_API_AUTH_STRING] = auth
    with patched_environ(**env), temporary_settings(updates):
        yield


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
