"""scheduler: reservations (a job's slots on each worker it runs on), the scheduler's lock row,
jobs.nnodes and jobs.preempt_requested
"""

import sqlalchemy as sa
from alembic import op

revision, down_revision = "0007", "0006"


def upgrade() -> None:
    op.create_table(
        "reservations",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("job_id", sa.Integer(), nullable=False),
        sa.Column("worker", sa.String(length=200), nullable=False),
        sa.Column("node_rank", sa.Integer(), nullable=False),
        sa.Column("nnodes", sa.Integer(), nullable=False),
        sa.Column("slots", sa.Integer(), nullable=False),
        sa.Column("gpus", sa.Integer(), nullable=False),
        sa.Column("ram_bytes", sa.BigInteger(), nullable=False),
        sa.Column("attempt", sa.Integer(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("sent_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("claimed_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("owner", sa.String(length=120), nullable=True),
        sa.Column("lease_until", sa.DateTime(timezone=True), nullable=True),
        sa.Column("rdzv_endpoint", sa.String(length=200), nullable=True),
        sa.ForeignKeyConstraint(["job_id"], ["jobs.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("job_id", "node_rank", name="uq_reservations_job_node"),
    )
    op.create_index("ix_reservations_job_id", "reservations", ["job_id"])
    op.create_index("ix_reservations_worker", "reservations", ["worker"])
    op.create_table(
        "scheduler_locks",
        sa.Column("name", sa.String(length=40), nullable=False),
        sa.Column("holder", sa.String(length=120), nullable=True),
        sa.Column("lease_until", sa.DateTime(timezone=True), nullable=True),
        sa.PrimaryKeyConstraint("name"),
    )
    with op.batch_alter_table("jobs") as batch_op:
        batch_op.add_column(sa.Column("nnodes", sa.Integer(), nullable=False, server_default="1"))
        batch_op.add_column(
            sa.Column("preempt_requested", sa.Boolean(), nullable=False, server_default=sa.false())
        )
    with op.batch_alter_table("jobs") as batch_op:
        batch_op.alter_column("nnodes", server_default=None)
        batch_op.alter_column("preempt_requested", server_default=None)


def downgrade() -> None:
    with op.batch_alter_table("jobs") as batch_op:
        batch_op.drop_column("preempt_requested")
        batch_op.drop_column("nnodes")
    op.drop_table("scheduler_locks")
    op.drop_index("ix_reservations_worker", table_name="reservations")
    op.drop_index("ix_reservations_job_id", table_name="reservations")
    op.drop_table("reservations")
