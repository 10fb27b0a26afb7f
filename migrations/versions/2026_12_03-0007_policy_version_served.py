"""when every backend serving a job confirmed a policy version, and which backends; the
gateway's backends and what each can serve

Revision ID: 0007_policy_version_served
Revises: 0006_memory_trainer_quotas
Create Date: 2026-12-03 12:00:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0007_policy_version_served"
down_revision = "0006_memory_trainer_quotas"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("policy_versions", schema=None) as batch_op:
        batch_op.add_column(sa.Column("served_at", sa.DateTime(timezone=True), nullable=True))
        batch_op.add_column(sa.Column("served_by", sa.JSON(), nullable=True))
    op.create_table(
        "inference_backends",
        sa.Column("name", sa.String(length=200), nullable=False),
        sa.Column("pool", sa.String(length=200), nullable=False),
        sa.Column("kind", sa.String(length=32), nullable=False),
        sa.Column("models", sa.JSON(), nullable=False),
        sa.Column("loads_models", sa.Boolean(), nullable=False),
        sa.Column("weights", sa.JSON(), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("name"),
    )


def downgrade() -> None:
    op.drop_table("inference_backends")
    with op.batch_alter_table("policy_versions", schema=None) as batch_op:
        batch_op.drop_column("served_by")
        batch_op.drop_column("served_at")
