"""jobs.last_loss: the latest training loss, for the live jobs table"""

import sqlalchemy as sa

from db.migrations.steps import add_columns, drop_columns

revision, down_revision = "0002", "0001"


def upgrade() -> None:
    add_columns("jobs", sa.Column("last_loss", sa.Float(), nullable=True))


def downgrade() -> None:
    drop_columns("jobs", "last_loss")
