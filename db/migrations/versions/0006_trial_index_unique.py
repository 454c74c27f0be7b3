"""trials: one trial per (selection, index), so two workers growing a batch at once cannot both
add the same trial
"""

from alembic import op

revision, down_revision = "0006", "0005"


def upgrade() -> None:
    with op.batch_alter_table("trials") as batch_op:
        batch_op.create_index("ux_trials_selection_index", ["selection_id", "index"], unique=True)


def downgrade() -> None:
    with op.batch_alter_table("trials") as batch_op:
        batch_op.drop_index("ux_trials_selection_index")
