"""jobs.handle (unique per tenant), jobs.tags and jobs.note: the names and labels people give jobs

Revision ID: 0009_job_handles
Revises: 0008_episode_steps_key
Create Date: 2026-12-04 04:00:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0009_job_handles"
down_revision = "0008_episode_steps_key"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.add_column(sa.Column("handle", sa.String(length=100), nullable=True))
        batch_op.add_column(sa.Column("tags", sa.JSON(), nullable=False, server_default="[]"))
        batch_op.add_column(sa.Column("note", sa.Text(), nullable=True))
        batch_op.create_index("ux_jobs_tenant_handle", ["tenant_id", "handle"], unique=True)


def downgrade() -> None:
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.drop_index("ux_jobs_tenant_handle")
        batch_op.drop_column("note")
        batch_op.drop_column("tags")
        batch_op.drop_column("handle")
