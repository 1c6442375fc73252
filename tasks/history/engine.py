"""The history database's engine: its URL, its connection settings, and which failures mean "down"."""

from __future__ import annotations

import ipaddress
from pathlib import Path
from typing import Any

from sqlalchemy import Engine, create_engine, event
from sqlalchemy import exc as sa_exc
from sqlalchemy.engine import URL, make_url

from spotrun.trainer.errors import ConfigError
from spotrun.trainer.redact import redact


def default_url(home: Path) -> str:
    """The embedded default: a SQLite file in the spotrun home."""
    return f"sqlite:///{(home / 'history.db').absolute()}"


URL_FORMS = "sqlite:///PATH or postgresql://USER@HOST[:PORT]/DB"
# Every PostgreSQL connection but a migration's: a statement that hangs gives up instead of holding
# the journal's lock. A URL's own `options=-c statement_timeout=...` wins over it.
STATEMENT_TIMEOUT_MS = 30_000
# A half-open connection (the server's host gone, a NAT dropped the flow) is found in about a minute,
# not TCP's ~15 min of retransmissions: keepalives while waiting for a reply, the user timeout while
# sent bytes go unacknowledged. A key the URL sets wins.
TCP_ARGS = {
    "keepalives": 1,
    "keepalives_idle": 30,
    "keepalives_interval": 10,
    "keepalives_count": 3,
    "tcp_user_timeout": 60_000,  # ms
}
SQLITE_MAGIC = b"SQLite format 3\x00"  # the first 16 bytes of every SQLite database file


def normalize_url(url: str) -> URL:
    """Parse a database URL; plain PostgreSQL URLs (and asyncpg ones) get the sync psycopg driver.
    ConfigError, one line naming the URL (password hidden) and the forms that work, for anything else."""
    try:
        u = make_url(url)
    except (sa_exc.ArgumentError, ValueError) as e:  # ValueError: a port that is not a number
        shown = redact(url)
        why = "its port is not a number" if "int()" in str(e) else "it is not a URL"
        raise ConfigError(f"SPOTRUN_DATABASE_URL {shown}: {why}; write {URL_FORMS}") from None
    if u.drivername in ("postgres", "postgresql", "postgresql+asyncpg"):
        u = u.set(drivername="postgresql+psycopg")
    if u.get_backend_name() not in ("sqlite", "postgresql"):
        shown = shown_url(u)
        raise ConfigError(
            f"SPOTRUN_DATABASE_URL {shown}: {u.get_backend_name()} is not supported; write {URL_FORMS}"
        )
    return u


def shown_url(url: URL) -> str:
    """The URL as logs and messages show it: password (and secret query parameters) hidden."""
    return redact(url.render_as_string(hide_password=True))


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
            head = b""
            if path.is_file():
                with open(path, "rb") as f:  # not read_bytes(): a 1M-attempt history is ~300 MB
                    head = f.read(len(SQLITE_MAGIC))
        except OSError as e:
            raise ConfigError(f"cannot read the history database {path}: {e.strerror}") from None
        if head and head != SQLITE_MAGIC:
            raise ConfigError(
                f"{path} is not a SQLite database; point SPOTRUN_DATABASE_URL at another file "
                "(a new one is created) or move this one away"
            )
    if u.get_backend_name() == "postgresql":
        sslmode(u)
    return u


def on_loopback(url: URL) -> bool:
    """Every host the URL names is loopback or a Unix socket (no host: libpq's default socket)."""
    hosts = [url.host or ""]
    for key in ("host", "hostaddr"):
        value = url.query.get(key)
        for v in (value,) if isinstance(value, str) else value or ():
            hosts += v.split(",")
    return all(_local_host(h.strip()) for h in hosts)


def _local_host(host: str) -> bool:
    if not host or host.startswith("/") or host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:  # a name other than localhost: it may resolve anywhere
        return False


def sslmode(url: URL) -> str | None:
    """The sslmode to connect with: the URL's own on loopback, `verify-full` off it (None: libpq's
    default). ConfigError, one line, for a weaker mode off loopback."""
    given = url.query.get("sslmode")
    mode = given if isinstance(given, str) or given is None else given[-1]
    if on_loopback(url) or mode == "verify-full":
        return mode
    if mode is None:
        return "verify-full"
    shown = shown_url(url)
    raise ConfigError(
        f"SPOTRUN_DATABASE_URL {shown}: sslmode={mode} off loopback lets anyone on the path read or change"
        " the history; remove sslmode (verify-full is used) or write sslmode=verify-full, with"
        " sslrootcert=PATH naming the server's CA"
    )


def pg_connect_args(url: URL, connect_timeout_s: float) -> dict[str, Any]:
    """libpq's settings for every connection: TLS off loopback, the statement and TCP timeouts.
    What the URL sets itself is left to the URL (these would override it)."""
    args: dict[str, Any] = {"connect_timeout": max(2, round(connect_timeout_s))}
    mode = sslmode(url)
    if mode is not None:
        args["sslmode"] = mode
    args |= TCP_ARGS
    own = url.query.get("options")
    own_options = " ".join((own,) if isinstance(own, str) else own or ())
    args["options"] = f"-c statement_timeout={STATEMENT_TIMEOUT_MS} {own_options}".strip()
    return {k: v for k, v in args.items() if k == "options" or k not in url.query}


def make_engine(url: URL, connect_timeout_s: float) -> Engine:
    if url.get_backend_name() == "postgresql":
        return create_engine(url, pool_pre_ping=True, connect_args=pg_connect_args(url, connect_timeout_s))
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
    return redact(f"{type(cause).__name__}: {first}")[:300]
