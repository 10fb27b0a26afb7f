"""episodes.steps_key: a finished episode's steps archived to object storage

Revision ID: 0008_episode_steps_key
Revises: 0007_policy_version_served
Create Date: 2026-12-04 02:00:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0008_episode_steps_key"
down_revision = "0007_policy_version_served"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("episodes", schema=None) as batch_op:
        batch_op.add_column(sa.Column("steps_key", sa.String(length=512), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("episodes", schema=None) as batch_op:
        batch_op.drop_column("steps_key")
