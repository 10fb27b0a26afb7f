"""when every backend serving a job confirmed a policy version, and which backends

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


def downgrade() -> None:
    with op.batch_alter_table("policy_versions", schema=None) as batch_op:
        batch_op.drop_column("served_by")
        batch_op.drop_column("served_at")
