"""reservations.trial_ids: a selection group's reservation names the trials its task runs

Revision ID: 0009
Revises: 0008
Create Date: 2026-11-23
"""

import sqlalchemy as sa
from alembic import op

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("reservations") as batch_op:
        batch_op.add_column(sa.Column("trial_ids", sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("reservations") as batch_op:
        batch_op.drop_column("trial_ids")
