"""api_tokens: parent_id (the token a session or token was made from) and last_used_at (a
session's idle expiry)

Revoking a token revokes what was made from it, so a session or a minted token cannot outlive
the token that made it.
"""

import sqlalchemy as sa
from alembic import op

revision, down_revision = "0012", "0011"


def upgrade() -> None:
    with op.batch_alter_table("api_tokens") as batch_op:
        batch_op.add_column(sa.Column("parent_id", sa.Integer(), nullable=True))
        batch_op.add_column(sa.Column("last_used_at", sa.DateTime(timezone=True), nullable=True))
        batch_op.create_foreign_key(
            "fk_api_tokens_parent_id_api_tokens", "api_tokens", ["parent_id"], ["id"], ondelete="CASCADE"
        )
        batch_op.create_index(batch_op.f("ix_api_tokens_parent_id"), ["parent_id"], unique=False)
    # sessions from before this revision belong to no token: end them (their users sign in again)
    op.execute(
        sa.text(
            "UPDATE api_tokens SET revoked_at = CURRENT_TIMESTAMP WHERE kind = 'session' AND revoked_at IS NULL"
        )
    )


def downgrade() -> None:
    with op.batch_alter_table("api_tokens") as batch_op:
        batch_op.drop_index(batch_op.f("ix_api_tokens_parent_id"))
        batch_op.drop_constraint("fk_api_tokens_parent_id_api_tokens", type_="foreignkey")
        batch_op.drop_column("last_used_at")
        batch_op.drop_column("parent_id")
