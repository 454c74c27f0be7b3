"""jobs.run_seconds: wall time its attempts have run, so max_runtime_s counts across attempts"""

import sqlalchemy as sa

from db.migrations.steps import add_columns, drop_columns

revision, down_revision = "0008", "0007"


def upgrade() -> None:
    add_columns("jobs", sa.Column("run_seconds", sa.Float(), nullable=False, server_default="0"))


def downgrade() -> None:
    drop_columns("jobs", "run_seconds")
