"""Databases for the history tests: a SQLite file, PostgreSQL on 127.0.0.1:5432, a relay that takes it down.

Each PostgreSQL test gets its own schema (via `search_path` in the URL) inside one database made per
test module: a fresh database per test would cost a checkpoint (~0.8 s) to drop each.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, fields
from pathlib import Path

import pytest
from sqlalchemy import create_engine

from spotrun.tasks.decisions.attempts import AttemptRecord, Outcome
from spotrun.tasks.history import HistoryStore
from spotrun.tasks.history.engine import normalize_url

PG_HOST, PG_PORT = "127.0.0.1", 5432
T0 = 1_700_000_000.0  # epoch seconds; multiples of 1/4 s survive the datetime round trip exactly


@pytest.fixture(scope="module")
def pg_database() -> Iterator[str]:
    """A fresh, uniquely named database on the local server (dropped at the end); skip if none answers."""
    psycopg = pytest.importorskip("psycopg")
    try:
        admin = psycopg.connect(
            host=PG_HOST, port=PG_PORT, user="postgres", dbname="test", connect_timeout=3, autocommit=True
        )
    except psycopg.Error as e:
        pytest.skip(f"PostgreSQL not reachable on {PG_HOST}:{PG_PORT}: {str(e).strip().splitlines()[0]}")
    name = f"spotrun_history_{uuid.uuid4().hex[:10]}"
    admin.execute(f'CREATE DATABASE "{name}"')
    try:
        yield name
    finally:
        admin.execute(f'DROP DATABASE "{name}" WITH (FORCE)')
        admin.close()


def pg_url(database: str, schema: str, port: int = PG_PORT, password: str = "") -> str:
    auth = f"postgres:{password}" if password else "postgres"
    return f"postgresql://{auth}@{PG_HOST}:{port}/{database}?options=-csearch_path%3D{schema}"


@pytest.fixture(params=["sqlite", "postgresql"])
def backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def db_url(backend: str, tmp_path: Path, request: pytest.FixtureRequest) -> str:
    """An empty database of the backend: a new SQLite file, or a new PostgreSQL schema."""
    if backend == "sqlite":
        return f"sqlite:///{tmp_path / 'history.db'}"
    database = request.getfixturevalue("pg_database")
    return pg_url(database, new_schema(database))


def new_schema(database: str) -> str:
    schema = f"t_{uuid.uuid4().hex[:10]}"
    engine = create_engine(normalize_url(pg_url(database, "public")))
    with engine.begin() as conn:
        conn.exec_driver_sql(f'CREATE SCHEMA "{schema}"')
    engine.dispose()
    return schema


# -- records --------------------------------------------------------------------------------------


def record(n: int, outcome: Outcome = Outcome.PREEMPTED, start: float = T0, **kw: object) -> AttemptRecord:
    base: dict[str, object] = dict(
        attempt=n,
        worker_id=f"local-{n}",
        provider="local",
        started_at=start + 100 * n,
        ended_at=start + 100 * n + 60.5,
        outcome=outcome,
        cause="spot notice (SIGTERM), exited PREEMPTED",
    )
    return AttemptRecord(**(base | kw))  # type: ignore[arg-type]


def same_record(row: AttemptRecord, rec: AttemptRecord) -> None:
    for f in fields(AttemptRecord):
        assert getattr(row, f.name) == getattr(rec, f.name), f.name


def new_run(store: HistoryStore, job: str = "digits") -> str:
    return store.start_job_run(
        job, "sha256:abc", "flow-run-1", storage_uri="file:///tmp/ckpt/digits", provider="local"
    )


# -- schema ---------------------------------------------------------------------------------------

# -- a database that is down ----------------------------------------------------------------------


class Relay:
    """A TCP relay on a fixed loopback port to the PostgreSQL server: stop it and the database is 'down'."""

    def __init__(self, port: int) -> None:
        self.port = port
        self._listener: socket.socket | None = None
        self._conns: list[socket.socket] = []

    def start(self) -> Relay:
        listener = socket.create_server(("127.0.0.1", self.port), reuse_port=False)
        self._listener = listener
        threading.Thread(target=self._accept, args=(listener,), daemon=True).start()
        return self

    def stop(self) -> None:
        if self._listener is not None:
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes the accept() in the relay's thread
            self._listener.close()
            self._listener = None
        for c in self._conns:
            with contextlib.suppress(OSError):  # close() alone leaves a recv() in another thread running
                c.shutdown(socket.SHUT_RDWR)
            c.close()
        self._conns.clear()

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return
            server = socket.create_connection((PG_HOST, PG_PORT))
            self._conns += [client, server]
            for a, b in ((client, server), (server, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        for s in (src, dst):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Outage:
    url: str  # a database that cannot be reached until `recover()`
    recover: Callable[[], object]
    secret: str  # the URL's password: it must never be logged


@pytest.fixture
def outage(backend: str, tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Outage]:
    if backend == "sqlite":
        blocker = tmp_path / "blocker"  # a file where the database's directory must go
        blocker.write_text("")
        yield Outage(f"sqlite:///{blocker / 'history.db'}", blocker.unlink, "")
        return
    database = request.getfixturevalue("pg_database")
    relay = Relay(free_port())  # nothing listens on its port until it starts
    yield Outage(pg_url(database, new_schema(database), relay.port, "s3cret"), relay.start, "s3cret")
    relay.stop()
