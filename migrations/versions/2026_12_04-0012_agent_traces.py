"""agent_keys and agent_calls: the credentials of agent episodes and the model calls their
agents made through the gateway's proxy (environment.kind: agent)

Revision ID: 0012_agent_traces
Revises: 0011_evaluation
Create Date: 2026-12-04 23:00:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0012_agent_traces"
down_revision = "0011_evaluation"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "agent_keys",
        sa.Column("key_hash", sa.String(64), primary_key=True),
        sa.Column(
            "episode_id", sa.String(64), sa.ForeignKey("episodes.id", ondelete="CASCADE"), nullable=False
        ),
        sa.Column("job_id", sa.String(64), nullable=False),
        sa.Column("tenant_id", sa.String(64), nullable=False),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
    )
    op.create_index("ix_agent_keys_episode_id", "agent_keys", ["episode_id"])
    op.create_table(
        "agent_calls",
        sa.Column(
            "id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), primary_key=True, autoincrement=True
        ),
        sa.Column(
            "episode_id", sa.String(64), sa.ForeignKey("episodes.id", ondelete="CASCADE"), nullable=False
        ),
        sa.Column("job_id", sa.String(64), nullable=False),
        sa.Column("attempt", sa.Integer(), nullable=False),
        sa.Column("request_id", sa.String(80), nullable=False, unique=True),
        sa.Column("policy_version", sa.Integer(), nullable=False),
        sa.Column("prompt_tokens", sa.Integer(), nullable=False),
        sa.Column("completion_tokens", sa.Integer(), nullable=False),
        sa.Column("finish_reason", sa.String(32), nullable=True),
        sa.Column("extends", sa.Boolean(), nullable=False),
        sa.Column("body_key", sa.String(512), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
    )
    op.create_index("ix_agent_calls_episode", "agent_calls", ["episode_id", "attempt", "id"])


def downgrade() -> None:
    op.drop_index("ix_agent_calls_episode", table_name="agent_calls")
    op.drop_table("agent_calls")
    op.drop_index("ix_agent_keys_episode_id", table_name="agent_keys")
    op.drop_table("agent_keys")
