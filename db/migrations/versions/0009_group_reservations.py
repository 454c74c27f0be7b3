"""reservations.trial_ids: a selection group's reservation names the trials its task runs"""

import sqlalchemy as sa

from db.migrations.steps import add_columns, drop_columns

revision, down_revision = "0009", "0008"


def upgrade() -> None:
    add_columns("reservations", sa.Column("trial_ids", sa.JSON(), nullable=True))


def downgrade() -> None:
    drop_columns("reservations", "trial_ids")
