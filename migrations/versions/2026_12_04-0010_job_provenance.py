"""jobs.provenance: what a job was made from (seeds, spec digest, Temper's version and commit,
model and task-set digests), recorded at submission

Revision ID: 0010_job_provenance
Revises: 0009_job_handles
Create Date: 2026-12-04 19:00:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0010_job_provenance"
down_revision = "0009_job_handles"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.add_column(sa.Column("provenance", sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.drop_column("provenance")
