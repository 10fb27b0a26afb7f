"""quotas on sandbox memory (GB-seconds) and trainer time; what each episode and version used

Revision ID: 0006_memory_trainer_quotas
Revises: 0005_fairshare
Create Date: 2026-12-02 16:00:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0006_memory_trainer_quotas"
down_revision = "0005_fairshare"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("tenants", schema=None) as batch_op:
        batch_op.add_column(sa.Column("quota_sandbox_memory_gb_s", sa.Float(), nullable=True))
        batch_op.add_column(sa.Column("quota_trainer_s", sa.Float(), nullable=True))
    with op.batch_alter_table("episodes", schema=None) as batch_op:
        batch_op.add_column(sa.Column("sandbox_memory_gb_s", sa.Float(), nullable=False, server_default="0"))
    with op.batch_alter_table("policy_versions", schema=None) as batch_op:
        batch_op.add_column(sa.Column("train_s", sa.Float(), nullable=False, server_default="0"))


def downgrade() -> None:
    with op.batch_alter_table("policy_versions", schema=None) as batch_op:
        batch_op.drop_column("train_s")
    with op.batch_alter_table("episodes", schema=None) as batch_op:
        batch_op.drop_column("sandbox_memory_gb_s")
    with op.batch_alter_table("tenants", schema=None) as batch_op:
        batch_op.drop_column("quota_trainer_s")
        batch_op.drop_column("quota_sandbox_memory_gb_s")
