"""PostgreSQL databases for Prefect servers in tests and benchmarks (the machine's PostgreSQL on
127.0.0.1:5432, trust auth, as the history tests use it), each a copy of one migrated template.

A Prefect server on an empty PostgreSQL database spends ~11 s creating its 37 tables (2 cores); a copy
of a migrated database (`CREATE DATABASE ... TEMPLATE`) takes well under a second, and a server on it
answers in the time of a warm start. So every test gets a database of its own, dropped after it: runs
never see another test's flow runs or automations, and two workers never share one.
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import psycopg

from spotrun.trainer.storage.locks import flock_within
from tests.prefect_server import MEMO, PrefectServer, _template_root

PG = "postgresql://postgres@127.0.0.1:5432"
ADMIN_DB = "test"  # connected to for CREATE/DROP DATABASE; never used otherwise
PG_MEMO = f"pg-{MEMO}"  # the template server's block registration hash, beside the SQLite template's


def connect() -> psycopg.Connection[tuple[object, ...]]:
    """An autocommit admin connection; psycopg.OperationalError when PostgreSQL does not answer."""
    return psycopg.connect(f"{PG}/{ADMIN_DB}", autocommit=True, connect_timeout=3)


def unreachable() -> str | None:
    """Why PostgreSQL cannot be used here (one line), or None when it answers."""
    try:
        connect().close()
    except psycopg.OperationalError as e:
        return f"PostgreSQL not reachable on 127.0.0.1:5432: {str(e).strip().splitlines()[0]}"
    return None


def _template_name() -> str:
    import prefect

    return "spotrun_prefect_tmpl_" + prefect.__version__.replace(".", "_").replace("+", "_")


def _exists(conn: psycopg.Connection[tuple[object, ...]], name: str) -> bool:
    return conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", (name,)).fetchone() is not None


def template(conn: psycopg.Connection[tuple[object, ...]]) -> str:
    """The migrated template database's name, made now by the first caller (others wait on a lock):
    a server started and stopped on a new database, which is then renamed, so the name exists only
    once the migration is complete."""
    name, root = _template_name(), _template_root()
    root.mkdir(parents=True, exist_ok=True)
    with flock_within(root / "pg-lock", 300, "the Prefect template database on PostgreSQL"):
        if _exists(conn, name):
            return name
        making = f"{name}_making"
        conn.execute(f'DROP DATABASE IF EXISTS "{making}" WITH (FORCE)')
        conn.execute(f'CREATE DATABASE "{making}"')
        work = Path(tempfile.mkdtemp(dir=root))
        server = PrefectServer(work, database=f"{PG}/{making}")
        server.start()
        server.stop()
        if (work / MEMO).is_file():
            shutil.copyfile(work / MEMO, root / PG_MEMO)
        shutil.rmtree(work, ignore_errors=True)
        conn.execute(f'ALTER DATABASE "{making}" RENAME TO "{name}"')
    return name


@contextlib.contextmanager
def fresh_database(prefix: str = "spotrun_prefect") -> Iterator[str]:
    """A new database copied from the migrated template, its URL yielded, dropped afterwards."""
    with contextlib.closing(connect()) as conn:
        source = template(conn)
        name = f"{prefix}_{uuid.uuid4().hex[:10]}"
        with flock_within(_template_root() / "pg-lock", 300, "the Prefect template database"):
            conn.execute(f'CREATE DATABASE "{name}" TEMPLATE "{source}"')
        try:
            yield f"{PG}/{name}"
        finally:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def seed_memo(prefect_home: Path) -> None:
    """The template server's block registration hash, so a server on a copy does not register again."""
    memo = _template_root() / PG_MEMO
    prefect_home.mkdir(parents=True, exist_ok=True)
    if memo.is_file() and not (prefect_home / MEMO).exists():
        shutil.copyfile(memo, prefect_home / MEMO)
