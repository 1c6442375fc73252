"""Which database the Prefect server keeps its runs in: SQLite under its home (the default), or a
PostgreSQL server a team shares (`--database`, SPOTRUN_PREFECT_DATABASE_URL).

Why PostgreSQL for a team: on SQLite one writer at a time holds the file, and under concurrent flow
runs the server answers `database is locked` as HTTP 503, which Prefect's client retries after ~2 s
(docs/operations.md); on PostgreSQL the same runs see no such waits, and Prefect's automations sync
across servers through LISTEN/NOTIFY. Measured here (bench/scale.py, docs/benchmarks.md): one server,
1 to 50 concurrent jobs, on each.

The server's driver is asyncpg (a dependency of Prefect, pinned in pyproject.toml): a plain
`postgresql://` URL, or the history database's `postgresql+psycopg://`, is given that driver, so one
URL form serves both databases.
"""

from __future__ import annotations

from sqlalchemy import exc as sa_exc
from sqlalchemy.engine import URL, make_url

from spotrun.trainer.errors import ConfigError
from spotrun.trainer.redact import redact

ENV = "SPOTRUN_PREFECT_DATABASE_URL"  # read by spotrun's commands (the edge); `--database` wins
FORMS = "postgresql://USER[:PASSWORD]@HOST[:PORT]/DB (or sqlite:///PATH)"
PREFECT_SETTING = "PREFECT_SERVER_DATABASE_CONNECTION_URL"  # what the server process is given


def server_database_url(url: str) -> str:
    """`url` with the driver Prefect's server uses (asyncpg, aiosqlite); ConfigError, one line naming
    the URL with its password hidden, for anything that is not a PostgreSQL or SQLite URL."""
    try:
        u = make_url(url.strip())
    except (sa_exc.ArgumentError, ValueError):
        raise ConfigError(f"Prefect database {redact(url)}: not a URL; write {FORMS}") from None
    backend = u.get_backend_name()
    if backend in ("postgres", "postgresql"):
        if not u.database:
            raise ConfigError(f"Prefect database {shown(u)}: name the database; write {FORMS}")
        return rendered(u.set(drivername="postgresql+asyncpg"))
    if backend == "sqlite":
        return rendered(u.set(drivername="sqlite+aiosqlite"))
    raise ConfigError(f"Prefect database {shown(u)}: {backend} is not supported; write {FORMS}")


def rendered(u: URL) -> str:
    return u.render_as_string(hide_password=False)


def shown(url: URL | str) -> str:
    """The URL as messages show it: password hidden."""
    u = make_url(url) if isinstance(url, str) else url
    return redact(u.render_as_string(hide_password=True))


def kind(url: str | None) -> str:
    """'PostgreSQL' or 'SQLite', for messages."""
    return "PostgreSQL" if url and url.startswith("postgresql") else "SQLite"
