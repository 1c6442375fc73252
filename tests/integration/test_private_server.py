"""A private control plane: spotrun's Prefect servers answer only their auth string, admit browsers
only from their own origin, want CSRF tokens for changes and keep their secrets' key in a 0600 file;
SPOTRUN_HOME is private; a local store keeps its own directory's mode; lock waits are bounded."""

from __future__ import annotations

import base64
import json
import os
import sqlite3
import stat
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from cryptography.fernet import Fernet

from spotrun.server import (
    AUTH_FILE,
    KEY_FILE,
    BindRefused,
    check_bind,
    encryption_key,
    server_home,
)
from spotrun.server import PrefectServer as Server  # what start() returns
from spotrun.trainer.errors import TransientStorageError
from spotrun.trainer.storage.local import LocalStorage
from spotrun.trainer.storage.locks import LockTimeout, flock_within
from tests.prefect_server import PrefectServer, seed
from tests.trainer_runs import REPO, trainer, write_spec

OLD_KEY = Fernet.generate_key().decode()  # what Prefect generated into prefect.db before this version
EVIL = "http://evil.example"


def request(
    url: str, method: str = "GET", auth: str | None = None, headers: dict[str, str] | None = None
) -> tuple[int, dict[str, str], str]:
    """(status, headers, body) of one request; an HTTP error status is a result, not an exception."""
    h = dict(headers or {})
    if auth is not None:
        h["Authorization"] = "Basic " + base64.b64encode(auth.encode()).decode()
    body = b"{}" if method == "POST" else None
    if body is not None:
        h.setdefault("Content-Type", "application/json")
    req = urllib.request.Request(url, data=body, headers=h, method=method)
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, dict(r.headers), r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read().decode()


def put_key_in_database(db: Path, key: str) -> None:
    with sqlite3.connect(db) as con:
        con.execute(
            "INSERT INTO configuration (id, key, value) VALUES (?, 'ENCRYPTION_KEY', ?)",
            ("00000000-0000-0000-0000-00000000abcd", json.dumps({"fernet_key": key})),
        )


def key_rows(db: Path) -> list[tuple[str]]:
    with sqlite3.connect(db) as con:
        return con.execute("SELECT value FROM configuration WHERE key = 'ENCRYPTION_KEY'").fetchall()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """A server whose database already holds a key of Prefect's own (a home from before this version)."""
    home = seed(tmp_path_factory.mktemp("private") / "prefect")
    put_key_in_database(home / "prefect.db", OLD_KEY)
    server = PrefectServer(home).start()
    try:
        yield server
    finally:
        server.stop()


def test_the_api_answers_only_its_auth_string(server: Server) -> None:
    api = server.api_url
    assert request(f"{api}/admin/version")[0] == 401
    assert request(f"{api}/flows/filter", "POST")[0] in (401, 403)  # 403: CSRF answers first
    assert request(f"{api}/admin/version", auth="spotrun:guess")[0] == 401
    assert request(f"{api}/admin/version", auth=server.auth)[0] == 200
    assert request(f"{api}/health")[0] == 200  # health stays open: how every command finds it
    assert server.auth.startswith("spotrun:") and len(server.auth) > 40


def test_another_origin_is_refused(server: Server) -> None:
    api, own = server.api_url, server.origins()[0]
    preflight = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization"}
    code, headers, _ = request(f"{api}/flows/filter", "OPTIONS", headers={"Origin": EVIL, **preflight})
    assert code == 400 and "access-control-allow-origin" not in {k.lower() for k in headers}
    code, headers, _ = request(f"{api}/flows/filter", "OPTIONS", headers={"Origin": own, **preflight})
    assert code == 200 and headers.get("access-control-allow-origin") == own
    # a page that sends without a preflight still needs a CSRF token to change anything
    code, headers, body = request(f"{api}/flows/", "POST", server.auth, {"Origin": EVIL})
    assert code == 403 and "CSRF" in body
    assert headers.get("access-control-allow-origin") != EVIL


def test_with_the_auth_string_a_flow_runs_and_secrets_use_the_key_file(server: Server) -> None:
    from prefect import flow
    from prefect.blocks.system import Secret

    @flow
    def hello(x: int) -> int:
        return x + 1

    with server.clients():
        state = hello(1, return_state=True)  # type: ignore[call-overload]
        Secret(value="https://hooks.slack.com/services/T/B/C").save("private-webhook", overwrite=True)
        assert Secret.load("private-webhook").get() == "https://hooks.slack.com/services/T/B/C"
    assert state.is_completed() and state.result() == 2
    db = server.home / "prefect.db"
    with sqlite3.connect(db) as con:
        assert con.execute("SELECT count(*) FROM csrf_token").fetchone()[0] >= 1  # the client asked for one
        (data,) = con.execute(
            "SELECT d.data FROM block_document d WHERE d.name = 'private-webhook'"
        ).fetchone()
    # Prefect's old key, copied into the key file, is the key: a Secret saved before still decrypts
    assert (server.home / KEY_FILE).read_text().strip() == OLD_KEY
    assert "hooks.slack.com" in Fernet(OLD_KEY.encode()).decrypt(json.loads(data).encode()).decode()
    assert key_rows(db) == []  # and it is no longer in the database
    for name in (AUTH_FILE, KEY_FILE):
        assert stat.S_IMODE((server.home / name).stat().st_mode) == 0o600, name


def test_a_new_key_when_the_database_has_none(tmp_path: Path) -> None:
    key = encryption_key(tmp_path)  # no prefect.db yet
    Fernet(key.encode())  # a valid Fernet key
    assert stat.S_IMODE((tmp_path / KEY_FILE).stat().st_mode) == 0o600
    (tmp_path / KEY_FILE).chmod(0o644)
    assert encryption_key(tmp_path) == key and stat.S_IMODE((tmp_path / KEY_FILE).stat().st_mode) == 0o600


@pytest.mark.parametrize(
    ("host", "public_url", "refused"),
    [
        ("127.0.0.1", None, False),
        ("127.0.0.2", None, False),
        ("::1", None, False),
        ("localhost", None, False),
        ("0.0.0.0", None, True),
        ("10.1.2.3", None, True),
        ("prefect.internal", None, True),  # a name may resolve off loopback
        ("0.0.0.0", "http://prefect.internal", True),  # no TLS
        ("0.0.0.0", "https://prefect.internal", False),
    ],
)
def test_a_bind_off_loopback_needs_tls(host: str, public_url: str | None, refused: bool) -> None:
    if refused:
        with pytest.raises(BindRefused, match="in clear"):
            check_bind(host, public_url)
    else:
        check_bind(host, public_url)


def spotrun(home: Path, *argv: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env |= {"PYTHONPATH": str(REPO), "SPOTRUN_HOME": str(home)}
    return subprocess.run(
        [sys.executable, "-m", "spotrun.cli", *argv], env=env, capture_output=True, text=True, timeout=120
    )


def test_server_start_off_loopback_is_refused_in_one_line(tmp_path: Path) -> None:
    r = spotrun(tmp_path / "home", "server", "start", "--host", "0.0.0.0", "--port", "0")
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.count("\n") == 1
    assert r.stderr.startswith("spotrun: error: --host 0.0.0.0 is not a loopback address")
    assert not server_home(tmp_path / "home").exists()  # nothing started, nothing written


def test_server_start_on_a_database_it_cannot_use_is_refused_in_one_line(tmp_path: Path) -> None:
    """--database (spotrun/prefect_db.py) takes PostgreSQL or SQLite; tests/e2e/test_prefect_postgres.py
    runs a server on PostgreSQL."""
    r = spotrun(tmp_path / "home", "server", "start", "--database", "mysql://u:s3cret@db/prefect")
    assert r.returncode == 2 and r.stdout == "" and r.stderr.count("\n") == 1, r.stderr
    assert r.stderr.startswith("spotrun: error: Prefect database mysql://u:***@db/prefect: mysql is not")
    assert not server_home(tmp_path / "home").exists()  # nothing started, nothing written


def test_a_fresh_home_made_by_the_trainer_is_private(tmp_path: Path) -> None:
    """`python -m spotrun.trainer` in a fresh SPOTRUN_HOME: its cache, checkpoints and logs there are
    private."""
    home = tmp_path / "fresh" / "home"
    spec = write_spec(tmp_path / "job.yaml", total_steps=7)
    env = {"SPOTRUN_HOME": str(home)}
    r = trainer(spec, str(home / "checkpoints" / "exact"), tmp_path, "--cache", str(home / "cache"), env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    made = [home, *home.rglob("*")]
    assert any(p.name == "model.safetensors" or p.suffix == ".pt" for p in made), made
    assert [p for p in made if p.stat().st_mode & 0o077] == []


def test_a_store_elsewhere_keeps_its_directory_mode(tmp_path: Path) -> None:
    """Under the private umask a store's files take the store directory's mode (a team's shared one
    stays shared); a private directory's stay private."""
    shared, private = tmp_path / "team", tmp_path / "mine"
    shared.mkdir(mode=0o775)
    shared.chmod(0o2775)
    private.mkdir(mode=0o700)
    old = os.umask(0o077)
    try:
        for root, dirs, files in ((shared / "job", 0o2775, 0o664), (private / "job", 0o700, 0o600)):
            store = LocalStorage(root)
            src = tmp_path / "src.bin"
            src.write_bytes(b"x")
            store.put("step_1/model.pt", src)
            staged = store.staging() / "part.bin"
            staged.write_bytes(b"y")
            store.adopt([("step_1/part.bin", staged)])
            store.put_if("step_1/latest", b"1", if_version=None)
            for d in (root, root / "step_1"):
                assert stat.S_IMODE(d.stat().st_mode) == dirs, d
            for name in ("model.pt", "part.bin", "latest"):
                assert stat.S_IMODE((root / "step_1" / name).stat().st_mode) == files, (root, name)
    finally:
        os.umask(old)


def test_lock_waits_are_bounded(tmp_path: Path) -> None:
    lock = tmp_path / "server.lock"
    held = pytest.raises(LockTimeout, match=f"held for 0 s by pid {os.getpid()}")
    with (
        flock_within(lock, 5, "the background Prefect server"),
        held,
        flock_within(lock, 0.2, "the background Prefect server"),
    ):
        pass  # pragma: no cover
    with flock_within(lock, 0.2, "free again"):
        pass
    assert stat.S_IMODE(lock.stat().st_mode) & 0o077 == 0


def test_a_stuck_put_if_lock_is_a_retryable_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import spotrun.trainer.storage.local as local

    monkeypatch.setattr(local, "LOCK_WAIT_S", 0.2)
    store = LocalStorage(tmp_path / "store")
    stuck = flock_within(tmp_path / "store" / f"latest{local.LOCK_SUFFIX}", 1, "a stuck writer")
    with stuck, pytest.raises(TransientStorageError, match="locked by another writer"):
        store.put_if("latest", b"1", if_version=None)
    assert store.put_if("latest", b"1", if_version=None)
