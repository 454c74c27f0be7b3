"""users and their tokens; owners of jobs and selections; why a queued job waits"""

import sqlalchemy as sa
from alembic import op

revision, down_revision = "0004", "0003"


def upgrade() -> None:
    op.create_table(
        "users",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(length=64), nullable=False),
        sa.Column("is_admin", sa.Boolean(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("max_running_jobs", sa.Integer(), nullable=True),
        sa.Column("max_ranks", sa.Integer(), nullable=True),
        sa.Column("max_gpus", sa.Integer(), nullable=True),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("name"),
    )
    op.create_table(
        "api_tokens",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("user_id", sa.Integer(), nullable=False),
        sa.Column("kind", sa.String(length=16), nullable=False),
        sa.Column("label", sa.String(length=64), nullable=False),
        sa.Column("token_hash", sa.String(length=64), nullable=False),
        sa.Column("prefix", sa.String(length=16), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("revoked_at", sa.DateTime(timezone=True), nullable=True),
        sa.ForeignKeyConstraint(["user_id"], ["users.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("token_hash", name="uq_api_tokens_token_hash"),
    )
    with op.batch_alter_table("api_tokens") as batch_op:
        batch_op.create_index(batch_op.f("ix_api_tokens_user_id"), ["user_id"], unique=False)
    with op.batch_alter_table("jobs") as batch_op:
        batch_op.add_column(sa.Column("owner_id", sa.Integer(), nullable=True))
        batch_op.add_column(sa.Column("wait_reason", sa.Text(), nullable=True))
        batch_op.create_foreign_key(
            "fk_jobs_owner_id_users", "users", ["owner_id"], ["id"], ondelete="SET NULL"
        )
        batch_op.create_index("ix_jobs_owner_id_id", ["owner_id", "id"], unique=False)
    with op.batch_alter_table("selections") as batch_op:
        batch_op.add_column(sa.Column("owner_id", sa.Integer(), nullable=True))
        batch_op.create_foreign_key(
            "fk_selections_owner_id_users", "users", ["owner_id"], ["id"], ondelete="SET NULL"
        )
        batch_op.create_index(batch_op.f("ix_selections_owner_id"), ["owner_id"], unique=False)


def downgrade() -> None:
    with op.batch_alter_table("selections") as batch_op:
        batch_op.drop_index(batch_op.f("ix_selections_owner_id"))
        batch_op.drop_constraint("fk_selections_owner_id_users", type_="foreignkey")
        batch_op.drop_column("owner_id")
    with op.batch_alter_table("jobs") as batch_op:
        batch_op.drop_index("ix_jobs_owner_id_id")
        batch_op.drop_constraint("fk_jobs_owner_id_users", type_="foreignkey")
        batch_op.drop_column("wait_reason")
        batch_op.drop_column("owner_id")
    with op.batch_alter_table("api_tokens") as batch_op:
        batch_op.drop_index(batch_op.f("ix_api_tokens_user_id"))
    op.drop_table("api_tokens")
    op.drop_table("users")
