"""Keyed job runs (scheduled retraining): each job run names its run key, the template values and the
runs it was resolved against (warm start, champion), and the promotion decision at its end.

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-06
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0005"
down_revision: str | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

COLUMNS = ("run_key", "run_values", "lineage", "promotion")


def upgrade() -> None:
    # Nullable: unkeyed jobs, and runs before this revision, have none.
    op.add_column("job_runs", sa.Column("run_key", sa.String(64), nullable=True))
    for name in COLUMNS[1:]:
        op.add_column("job_runs", sa.Column(name, sa.JSON(), nullable=True))
    op.create_index("ix_job_runs_job_run_key", "job_runs", ["job", "run_key"])


def downgrade() -> None:
    op.drop_index("ix_job_runs_job_run_key", table_name="job_runs")
    with op.batch_alter_table("job_runs") as batch:  # SQLite drops a column by copying the table
        for name in COLUMNS:
            batch.drop_column(name)
