"""The history database's engine: its URL, its connection settings, and which failures mean "down"."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from sqlalchemy import Engine, create_engine, event
from sqlalchemy import exc as sa_exc
from sqlalchemy.engine import URL, make_url

from trainer.errors import ConfigError


def default_url(home: Path) -> str:
    """The embedded default: a SQLite file in the spotrun home."""
    return f"sqlite:///{(home / 'history.db').absolute()}"


URL_FORMS = "sqlite:///PATH or postgresql://USER@HOST[:PORT]/DB"
SQLITE_MAGIC = b"SQLite format 3\x00"  # the first 16 bytes of every SQLite database file


def normalize_url(url: str) -> URL:
    """Parse a database URL; plain PostgreSQL URLs (and asyncpg ones) get the sync psycopg driver.
    ConfigError, one line naming the URL (password hidden) and the forms that work, for anything else."""
    try:
        u = make_url(url)
    except (sa_exc.ArgumentError, ValueError) as e:  # ValueError: a port that is not a number
        shown = _hide_password(url)
        why = "its port is not a number" if "int()" in str(e) else "it is not a URL"
        raise ConfigError(f"SPOTRUN_DATABASE_URL {shown}: {why}; write {URL_FORMS}") from None
    if u.drivername in ("postgres", "postgresql", "postgresql+asyncpg"):
        u = u.set(drivername="postgresql+psycopg")
    if u.get_backend_name() not in ("sqlite", "postgresql"):
        shown = u.render_as_string(hide_password=True)
        raise ConfigError(
            f"SPOTRUN_DATABASE_URL {shown}: {u.get_backend_name()} is not supported; write {URL_FORMS}"
        )
    return u


def check_database_url(url: str) -> URL:
    """normalize_url, and a SQLite file that exists must be a SQLite database (ConfigError if not):
    checked before anything is written, so a wrong path never gets a table or a journal."""
    u = normalize_url(url)
    db = u.database
    if u.get_backend_name() == "sqlite" and db not in (None, "", ":memory:"):
        path = Path(db)
        if path.is_dir():
            raise ConfigError(f"SPOTRUN_DATABASE_URL names a directory ({path}); name a file in it")
        try:
            head = path.read_bytes()[:16] if path.is_file() else b""
        except OSError as e:
            raise ConfigError(f"cannot read the history database {path}: {e.strerror}") from None
        if head and head != SQLITE_MAGIC:
            raise ConfigError(
                f"{path} is not a SQLite database; point SPOTRUN_DATABASE_URL at another file "
                "(a new one is created) or move this one away"
            )
    return u


def _hide_password(url: str) -> str:
    scheme, sep, rest = url.partition("://")
    creds, at, host = rest.rpartition("@")
    if not at or ":" not in creds:
        return url
    return f"{scheme}{sep}{creds.partition(':')[0]}:***@{host}"


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
