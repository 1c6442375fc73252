"""The history database's engine: its URL, its connection settings, and which failures mean "down"."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from sqlalchemy import Engine, create_engine, event
from sqlalchemy import exc as sa_exc
from sqlalchemy.engine import URL, make_url


def default_url(home: Path) -> str:
    """The embedded default: a SQLite file in the spotrun home."""
    return f"sqlite:///{(home / 'history.db').absolute()}"


def normalize_url(url: str) -> URL:
    """Parse a database URL; plain PostgreSQL URLs (and asyncpg ones) get the sync psycopg driver."""
    try:
        u = make_url(url)
    except sa_exc.ArgumentError as e:
        raise ValueError(f"database URL {url!r} is not a URL: write sqlite:///PATH or postgresql://…") from e
    if u.drivername in ("postgres", "postgresql", "postgresql+asyncpg"):
        u = u.set(drivername="postgresql+psycopg")
    return u


def make_engine(url: URL, connect_timeout_s: float) -> Engine:
    if url.get_backend_name() == "postgresql":
        return create_engine(
            url, pool_pre_ping=True, connect_args={"connect_timeout": max(2, round(connect_timeout_s))}
        )
    if url.get_backend_name() != "sqlite":
        return create_engine(url, pool_pre_ping=True)
    # The busy timeout: wait out another process's write (or migration) instead of failing.
    engine = create_engine(url, pool_pre_ping=True, connect_args={"timeout": 30.0})

    @event.listens_for(engine, "connect")
    def _foreign_keys_on(dbapi_conn: Any, _record: Any) -> None:  # as PostgreSQL enforces them
        cur = dbapi_conn.cursor()
        cur.execute("PRAGMA foreign_keys = ON")
        cur.close()

    return engine


def unreachable(e: BaseException) -> bool:
    """A connection-level failure: retrying later may succeed."""
    if isinstance(e, sa_exc.DBAPIError) and e.connection_invalidated:
        return True
    connection_level = (sa_exc.OperationalError, sa_exc.InterfaceError, sa_exc.DisconnectionError)
    return isinstance(e, (*connection_level, sa_exc.TimeoutError, OSError))


def one_line(e: BaseException) -> str:
    cause = getattr(e, "orig", None) or e  # the driver's message, without SQLAlchemy's SQL echo
    first = (str(cause).strip().splitlines() or [""])[0]
    return f"{type(cause).__name__}: {first}"[:300]
