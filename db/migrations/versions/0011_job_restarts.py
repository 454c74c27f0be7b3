"""jobs.restarts: attempts retried after an infrastructure failure, bounded by max_restarts"""

import sqlalchemy as sa

from db.migrations.steps import add_columns, drop_columns

revision, down_revision = "0011", "0010"


def upgrade() -> None:
    add_columns("jobs", sa.Column("restarts", sa.Integer(), nullable=False, server_default="0"))


def downgrade() -> None:
    drop_columns("jobs", "restarts")
