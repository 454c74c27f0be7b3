"""leases and fencing: jobs.owner/lease_until/applied_seq/applied_step, unique metric steps,
trials.result
"""

import sqlalchemy as sa
from alembic import op

revision, down_revision = "0003", "0002"


def upgrade() -> None:
    with op.batch_alter_table("jobs") as batch_op:
        batch_op.add_column(sa.Column("owner", sa.String(length=120), nullable=True))
        batch_op.add_column(sa.Column("lease_until", sa.DateTime(timezone=True), nullable=True))
        batch_op.add_column(sa.Column("applied_seq", sa.Integer(), nullable=False, server_default="-1"))
        batch_op.add_column(sa.Column("applied_step", sa.Integer(), nullable=False, server_default="0"))
    with op.batch_alter_table("jobs") as batch_op:
        batch_op.alter_column("applied_seq", server_default=None)
        batch_op.alter_column("applied_step", server_default=None)
    with op.batch_alter_table("trials") as batch_op:
        batch_op.add_column(sa.Column("result", sa.JSON(), nullable=True))
    # keep the newest row of each (job, name, step) before the index makes them unique
    op.execute(
        "DELETE FROM metric_points WHERE id NOT IN "
        "(SELECT MAX(id) FROM metric_points GROUP BY job_id, name, step)"
    )
    with op.batch_alter_table("metric_points") as batch_op:
        batch_op.drop_index("ix_metric_points_job_name_step")
        batch_op.create_index("ix_metric_points_job_name_step", ["job_id", "name", "step"], unique=True)


def downgrade() -> None:
    with op.batch_alter_table("metric_points") as batch_op:
        batch_op.drop_index("ix_metric_points_job_name_step")
        batch_op.create_index("ix_metric_points_job_name_step", ["job_id", "name", "step"], unique=False)
    with op.batch_alter_table("trials") as batch_op:
        batch_op.drop_column("result")
    with op.batch_alter_table("jobs") as batch_op:
        batch_op.drop_column("applied_step")
        batch_op.drop_column("applied_seq")
        batch_op.drop_column("lease_until")
        batch_op.drop_column("owner")
