"""Alembic environment: runs on the connection `upgrade_to_head` passes in (no alembic.ini needed).

From the alembic command line, `sqlalchemy.url` in the config names the database instead.
"""

from __future__ import annotations

from alembic import context
from sqlalchemy import Connection, create_engine

from spotrun.tasks.history.migrations import VERSION_TABLE
from spotrun.tasks.history.models import Base


def run(connection: Connection) -> None:
    context.configure(
        connection=connection,
        target_metadata=Base.metadata,
        version_table=VERSION_TABLE,
        render_as_batch=connection.dialect.name == "sqlite",  # SQLite alters tables by copying them
        transactional_ddl=True,  # SQLite has transactional DDL too: a migration lands whole or not at all
    )
    with context.begin_transaction():
        context.run_migrations()


given = context.config.attributes.get("connection")
if given is not None:
    run(given)
else:
    engine = create_engine(context.config.get_main_option("sqlalchemy.url") or "")
    with engine.connect() as conn:
        run(conn)
    engine.dispose()
