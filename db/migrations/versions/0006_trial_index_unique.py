"""trials: one trial per (selection, index), so two workers growing a batch at once cannot both
add the same trial

Revision ID: 0006
Revises: 0005
Create Date: 2026-11-23
"""

from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("trials") as batch_op:
        batch_op.create_index("ux_trials_selection_index", ["selection_id", "index"], unique=True)


def downgrade() -> None:
    with op.batch_alter_table("trials") as batch_op:
        batch_op.drop_index("ux_trials_selection_index")
