"""Job runs name the MLflow run their metrics, preemptions and model go to (docs/tracking.md).

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-01
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0004"
down_revision: str | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    # Nullable: runs before this revision, and runs with tracking off, have none.
    op.add_column("job_runs", sa.Column("mlflow_run_id", sa.String(64), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("job_runs") as batch:  # SQLite drops a column by copying the table
        batch.drop_column("mlflow_run_id")
