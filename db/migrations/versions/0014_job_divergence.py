"""jobs.divergence: why a run counts as diverged (its final smoothed loss far above its first)"""

import sqlalchemy as sa

from db.migrations.steps import add_columns, drop_columns

revision, down_revision = "0014", "0013"


def upgrade() -> None:
    add_columns("jobs", sa.Column("divergence", sa.Text(), nullable=True))


def downgrade() -> None:
    drop_columns("jobs", "divergence")
