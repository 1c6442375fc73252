"""Indexes for the newest-first reads of a history a team grows to a million attempts: `spotrun history`
(all jobs, one job, one run key) and `spotrun report` (a job's newest run, a run by its id's prefix).

Without them each of those reads sorted the whole attempts table (SQLite: a temp B-tree over every row;
PostgreSQL: a parallel sequential scan and a top-N sort); with them each reads its rows off the end of an
index. Measured on 1M generated attempts (bench/history_scale.py, docs/benchmarks.md).

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-20
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

revision: str = "0006"
down_revision: str | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# name -> (table, columns); the same as tasks/history/models.py declares
INDEXES = {
    "ix_attempts_started_at_attempt_id": ("attempts", ["started_at", "attempt", "id"]),
    "ix_attempts_job_started_at_attempt_id": ("attempts", ["job", "started_at", "attempt", "id"]),
    "ix_job_runs_started_at_id": ("job_runs", ["started_at", "id"]),
    "ix_job_runs_run_key": ("job_runs", ["run_key"]),
}


def upgrade() -> None:
    for name, (table, columns) in INDEXES.items():
        op.create_index(name, table, columns)


def downgrade() -> None:
    for name, (table, _) in INDEXES.items():
        op.drop_index(name, table_name=table)
