"""Job runs, their append-only attempts, and checkpoint rejections.

Revision ID: 0001
Revises:
Create Date: 2025-11-30
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0001"
down_revision: str | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "job_runs",
        sa.Column("id", sa.String(36), nullable=False),
        sa.Column("job", sa.String(255), nullable=False),
        sa.Column("spec_hash", sa.String(128), nullable=False),
        sa.Column("flow_run_id", sa.String(64), nullable=True),
        sa.Column("storage_uri", sa.Text(), nullable=False),
        sa.Column("provider", sa.String(64), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("message", sa.Text(), nullable=False),
        sa.Column("started_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("ended_at", sa.DateTime(timezone=True), nullable=True),
        sa.PrimaryKeyConstraint("id", name="pk_job_runs"),
    )
    op.create_index("ix_job_runs_job_started_at", "job_runs", ["job", "started_at"])

    op.create_table(
        "attempts",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("job_run_id", sa.String(36), nullable=False),
        sa.Column("job", sa.String(255), nullable=False),
        sa.Column("attempt", sa.Integer(), nullable=False),
        sa.Column("worker_id", sa.Text(), nullable=False),
        sa.Column("provider", sa.String(64), nullable=False),
        sa.Column("started_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("ended_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("outcome", sa.String(32), nullable=False),
        sa.Column("cause", sa.Text(), nullable=False),
        sa.Column("exit_code", sa.Integer(), nullable=True),
        sa.Column("signal", sa.Integer(), nullable=True),
        sa.Column("trainer_code", sa.String(64), nullable=True),
        sa.Column("error", sa.Text(), nullable=False),
        sa.Column("log_tail", sa.Text(), nullable=False),
        sa.Column("resumed_from", sa.Integer(), nullable=True),
        sa.Column("resumed_checkpoint", sa.Text(), nullable=True),
        sa.Column("last_step", sa.Integer(), nullable=False),
        sa.Column("last_durable_step", sa.Integer(), nullable=True),
        sa.Column("lost_steps", sa.Integer(), nullable=False),
        sa.Column("notice_lead_s", sa.Float(), nullable=True),
        sa.Column("wall_s", sa.Float(), nullable=False),
        sa.Column("productive_s", sa.Float(), nullable=False),
        sa.Column("extra", sa.JSON(), nullable=False),
        sa.ForeignKeyConstraint(
            ["job_run_id"], ["job_runs.id"], name="fk_attempts_job_run_id_job_runs", ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("id", name="pk_attempts"),
        sa.UniqueConstraint("job_run_id", "attempt", name="uq_attempts_job_run_id_attempt"),
    )
    op.create_index("ix_attempts_job_ended_at", "attempts", ["job", "ended_at"])

    op.create_table(
        "checkpoint_rejections",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("job_run_id", sa.String(36), nullable=False),
        sa.Column("attempt", sa.Integer(), nullable=False),
        sa.Column("step", sa.Integer(), nullable=False),
        sa.Column("reasons", sa.Text(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["job_run_id"],
            ["job_runs.id"],
            name="fk_checkpoint_rejections_job_run_id_job_runs",
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name="pk_checkpoint_rejections"),
    )
    op.create_index(
        "ix_checkpoint_rejections_job_run_id", "checkpoint_rejections", ["job_run_id"], unique=False
    )


def downgrade() -> None:
    op.drop_index("ix_checkpoint_rejections_job_run_id", table_name="checkpoint_rejections")
    op.drop_table("checkpoint_rejections")
    op.drop_index("ix_attempts_job_ended_at", table_name="attempts")
    op.drop_table("attempts")
    op.drop_index("ix_job_runs_job_started_at", table_name="job_runs")
    op.drop_table("job_runs")
