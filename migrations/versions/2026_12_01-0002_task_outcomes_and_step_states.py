"""task outcomes, one row per scored episode; step states settled

A task's attempts, passes and measured difficulty are no longer counters on ``tasks``
(two writers counted every scored episode twice): they are counted from
``task_outcomes``, one row per scored episode, written by the dispatcher. The old
counters are dropped rather than carried over, since they double counted. Steps lose
the ``expired`` state (the lease task that set it is gone; such a step was still waiting
and is ``leased`` again, for the dispatcher's reaper to retry).

Revision ID: 0002
Revises: 0001
Create Date: 2026-12-01 03:30:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "task_outcomes",
        sa.Column(
            "id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), autoincrement=True, nullable=False
        ),
        sa.Column("episode_id", sa.String(length=64), nullable=False),
        sa.Column("task_id", sa.String(length=200), nullable=False),
        sa.Column("job_id", sa.String(length=64), nullable=False),
        sa.Column("policy_version", sa.Integer(), nullable=True),
        sa.Column("passed", sa.Boolean(), nullable=False),
        sa.Column("reward", sa.Float(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(["episode_id"], ["episodes.id"], ondelete="CASCADE"),
        sa.ForeignKeyConstraint(["job_id"], ["jobs.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("episode_id"),
    )
    with op.batch_alter_table("task_outcomes", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_task_outcomes_task_id"), ["task_id"], unique=False)
        batch_op.create_index("ix_task_outcomes_job_version", ["job_id", "policy_version"], unique=False)
    with op.batch_alter_table("tasks", schema=None) as batch_op:
        batch_op.drop_column("difficulty")
        batch_op.drop_column("passes")
        batch_op.drop_column("attempts")
    op.execute("UPDATE steps SET state = 'leased' WHERE state = 'expired'")


def downgrade() -> None:
    with op.batch_alter_table("tasks", schema=None) as batch_op:
        batch_op.add_column(sa.Column("attempts", sa.Integer(), nullable=False, server_default="0"))
        batch_op.add_column(sa.Column("passes", sa.Integer(), nullable=False, server_default="0"))
        batch_op.add_column(sa.Column("difficulty", sa.Float(), nullable=True))
    # the counters come back from the rows, each episode counted once
    op.execute(
        "UPDATE tasks SET"
        " attempts = (SELECT count(*) FROM task_outcomes o WHERE o.task_id = tasks.id),"
        " passes = (SELECT count(*) FROM task_outcomes o WHERE o.task_id = tasks.id AND o.passed)"
    )
    op.execute("UPDATE steps SET state = 'failed' WHERE state = 'cancelled'")
    with op.batch_alter_table("task_outcomes", schema=None) as batch_op:
        batch_op.drop_index("ix_task_outcomes_job_version")
        batch_op.drop_index(batch_op.f("ix_task_outcomes_task_id"))
    op.drop_table("task_outcomes")
