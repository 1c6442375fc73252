"""Job runs count the controllers that adopted them after the one before died.

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-07
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0003"
down_revision: str | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    # The server default fills the rows already there; (job_run_id, attempt) is unique since 0001.
    op.add_column(
        "job_runs",
        sa.Column("controller_restarts", sa.Integer(), server_default=sa.text("0"), nullable=False),
    )


def downgrade() -> None:
    with op.batch_alter_table("job_runs") as batch:  # SQLite drops a column by copying the table
        batch.drop_column("controller_restarts")
