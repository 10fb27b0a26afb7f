"""tenant weights and quotas; what each episode consumed

Revision ID: 0005_fairshare
Revises: 0004
Create Date: 2026-12-02 01:00:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0005_fairshare"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("tenants", schema=None) as batch_op:
        batch_op.add_column(sa.Column("weight", sa.Float(), nullable=False, server_default="1"))
        batch_op.add_column(sa.Column("quota_sandbox_cpu_s", sa.Float(), nullable=True))
        batch_op.add_column(sa.Column("quota_inference_tokens", sa.BigInteger(), nullable=True))
    with op.batch_alter_table("episodes", schema=None) as batch_op:
        batch_op.add_column(sa.Column("sandbox_cpu_s", sa.Float(), nullable=False, server_default="0"))
        batch_op.add_column(
            sa.Column("inference_tokens", sa.BigInteger(), nullable=False, server_default="0")
        )


def downgrade() -> None:
    with op.batch_alter_table("episodes", schema=None) as batch_op:
        batch_op.drop_column("inference_tokens")
        batch_op.drop_column("sandbox_cpu_s")
    with op.batch_alter_table("tenants", schema=None) as batch_op:
        batch_op.drop_column("quota_inference_tokens")
        batch_op.drop_column("quota_sandbox_cpu_s")
        batch_op.drop_column("weight")
