"""evaluation: held-out tasks (tasks.split, task_sets.held_out), evaluations with their
per-task results and per-episode verdicts

Revision ID: 0011_evaluation
Revises: 0010_job_provenance
Create Date: 2026-12-04 21:00:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0011_evaluation"
down_revision = "0010_job_provenance"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("tasks", schema=None) as batch_op:
        batch_op.add_column(sa.Column("split", sa.String(length=16), nullable=False, server_default="train"))
    with op.batch_alter_table("task_sets", schema=None) as batch_op:
        batch_op.add_column(sa.Column("held_out", sa.JSON(), nullable=True))
    op.create_table(
        "evaluations",
        sa.Column("job_id", sa.String(length=64), nullable=False),
        sa.Column("tenant_id", sa.String(length=64), nullable=False),
        sa.Column("source_job_id", sa.String(length=64), nullable=False),
        sa.Column("version", sa.Integer(), nullable=True),
        sa.Column("model", sa.Text(), nullable=True),
        sa.Column("checkpoint_key", sa.String(length=512), nullable=True),
        sa.Column("label", sa.String(length=64), nullable=False),
        sa.Column("periodic", sa.Boolean(), nullable=False),
        sa.Column("periodic_key", sa.String(length=200), nullable=True),
        sa.Column("taskset_id", sa.String(length=64), nullable=False),
        sa.Column("split", sa.String(length=16), nullable=False),
        sa.Column("samples", sa.Integer(), nullable=False),
        sa.Column("pass_at", sa.JSON(), nullable=False),
        sa.Column("passed_by", sa.String(length=200), nullable=False),
        sa.Column("pass_threshold", sa.Float(), nullable=True),
        sa.Column("summary", sa.JSON(), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("completed_at", sa.DateTime(timezone=True), nullable=True),
        sa.ForeignKeyConstraint(["job_id"], ["jobs.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("job_id"),
        sa.UniqueConstraint("periodic_key"),
    )
    with op.batch_alter_table("evaluations", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_evaluations_tenant_id"), ["tenant_id"], unique=False)
        batch_op.create_index(batch_op.f("ix_evaluations_source_job_id"), ["source_job_id"], unique=False)
    op.create_table(
        "evaluation_results",
        sa.Column("job_id", sa.String(length=64), nullable=False),
        sa.Column("task_id", sa.String(length=200), nullable=False),
        sa.Column("samples", sa.Integer(), nullable=False),
        sa.Column("passed", sa.Integer(), nullable=False),
        sa.Column("pass_at", sa.JSON(), nullable=False),
        sa.Column("reward_mean", sa.Float(), nullable=False),
        sa.Column("components", sa.JSON(), nullable=False),
        sa.ForeignKeyConstraint(["job_id"], ["evaluations.job_id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("job_id", "task_id"),
    )
    op.create_table(
        "evaluation_outcomes",
        sa.Column("episode_id", sa.String(length=64), nullable=False),
        sa.Column("job_id", sa.String(length=64), nullable=False),
        sa.Column("task_id", sa.String(length=200), nullable=False),
        sa.Column("policy_version", sa.Integer(), nullable=True),
        sa.Column("passed", sa.Boolean(), nullable=False),
        sa.Column("reward", sa.Float(), nullable=False),
        sa.Column("components", sa.JSON(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(["episode_id"], ["episodes.id"], ondelete="CASCADE"),
        sa.ForeignKeyConstraint(["job_id"], ["jobs.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("episode_id"),
    )
    with op.batch_alter_table("evaluation_outcomes", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_evaluation_outcomes_job_id"), ["job_id"], unique=False)


def downgrade() -> None:
    with op.batch_alter_table("evaluation_outcomes", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_evaluation_outcomes_job_id"))
    op.drop_table("evaluation_outcomes")
    op.drop_table("evaluation_results")
    with op.batch_alter_table("evaluations", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_evaluations_source_job_id"))
        batch_op.drop_index(batch_op.f("ix_evaluations_tenant_id"))
    op.drop_table("evaluations")
    with op.batch_alter_table("task_sets", schema=None) as batch_op:
        batch_op.drop_column("held_out")
    with op.batch_alter_table("tasks", schema=None) as batch_op:
        batch_op.drop_column("split")
