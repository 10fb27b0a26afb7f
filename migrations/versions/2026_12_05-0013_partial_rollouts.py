"""episodes.partial_rollouts, .deadline_at and .model_tokens: an episode's own switch for
partial rollouts (an evaluation episode keeps it off), the wall-clock deadline its
environment.max_episode_s gives it, and the tokens its model sampled
(environment.max_episode_tokens)

Revision ID: 0013_partial_rollouts
Revises: 0012_agent_traces
Create Date: 2026-12-05 03:15:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0013_partial_rollouts"
down_revision = "0012_agent_traces"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("episodes", schema=None) as batch_op:
        batch_op.add_column(
            sa.Column("partial_rollouts", sa.Boolean(), nullable=False, server_default=sa.false())
        )
        batch_op.add_column(sa.Column("deadline_at", sa.DateTime(timezone=True), nullable=True))
        batch_op.add_column(sa.Column("model_tokens", sa.Integer(), nullable=False, server_default="0"))


def downgrade() -> None:
    with op.batch_alter_table("episodes", schema=None) as batch_op:
        batch_op.drop_column("model_tokens")
        batch_op.drop_column("deadline_at")
        batch_op.drop_column("partial_rollouts")
