"""Schema migrations, applied programmatically: `upgrade_to_head(engine)` on a store's first use.

Concurrent first use is safe: the upgrade runs inside one transaction that first takes the database's
own write lock (SQLite `BEGIN IMMEDIATE`, a PostgreSQL advisory lock), and alembic re-reads the
version under it, so the second process finds the schema at head and does nothing.
"""

from __future__ import annotations

from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import Connection, Engine, create_engine, text

HERE = Path(__file__).resolve().parent
# Not alembic's default name: the database may be shared (Prefect's own uses `alembic_version`).
VERSION_TABLE = "spotrun_alembic_version"
_PG_LOCK_KEY = 0x5F07_2B0B  # pg_advisory_xact_lock key for spotrun's migrations


def alembic_config(connection: Connection | None = None) -> Config:
    """An alembic Config for these migrations, running on `connection` when one is given."""
    cfg = Config()
    cfg.set_main_option("script_location", str(HERE))
    cfg.attributes["connection"] = connection
    return cfg


def head_revision() -> str | None:
    """The newest revision these migrations know."""
    return ScriptDirectory.from_config(alembic_config()).get_current_head()


def current_revision(connection: Connection) -> str | None:
    """The revision the database is at (None: no schema yet)."""
    ctx = MigrationContext.configure(connection, opts={"version_table": VERSION_TABLE})
    return ctx.get_current_revision()


def upgrade_to_head(bind: Engine | str) -> None:
    """Bring the schema to head; a no-op (one read) when it is there already."""
    engine = create_engine(bind) if isinstance(bind, str) else bind
    try:
        head = head_revision()
        with engine.connect() as conn:
            if current_revision(conn) == head:
                return
        with engine.connect() as conn:
            _lock(conn)
            command.upgrade(alembic_config(conn), "head")
            conn.commit()
    finally:
        if isinstance(bind, str):
            engine.dispose()


def _lock(conn: Connection) -> None:
    """Start the migration transaction holding the database's write lock until commit."""
    if conn.dialect.name == "sqlite":
        # pysqlite opens no transaction before DDL by itself; this one also waits out a concurrent
        # migrator (the busy timeout) instead of racing it to CREATE TABLE.
        conn.exec_driver_sql("BEGIN IMMEDIATE")
    elif conn.dialect.name == "postgresql":
        # No statement timeout here alone: a migration's DDL and index builds, and the wait for
        # another migrator, may take longer than any write (this transaction only).
        conn.exec_driver_sql("SET LOCAL statement_timeout = 0")
        conn.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": _PG_LOCK_KEY})
