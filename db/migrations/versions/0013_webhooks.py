"""webhooks, their outbox (webhook_deliveries) and delivery log (webhook_attempts); triggers that
fill the outbox when a job or a batch ends

The outbox rows come from triggers, not from Python: a job reaches a terminal status along many
paths (the worker's finish, a failed attempt out of retries, a cancel, a lapsed gang, a batch's
settle), and a trigger writes the row in the same transaction as every one of them, present and
future, so an end is never lost and never notified twice (the trigger fires only on the change
from a live status to an ended one).
"""

import sqlalchemy as sa
from alembic import op

revision, down_revision = "0013", "0012"

ENDED = "('succeeded', 'failed', 'cancelled')"
# (table, event, which rows of the table notify)
SOURCES = (("jobs", "job.ended", "NEW.kind = 'job'"), ("selections", "selection.ended", "1 = 1"))


def _insert(event: str, now: str) -> str:
    return f"""
        INSERT INTO webhook_deliveries
            (webhook_id, event, object_id, status, state, attempts, created_at, next_at)
        SELECT w.id, '{event}', NEW.id, NEW.status, 'pending', 0, {now}, {now}
        FROM webhooks w
        WHERE w.user_id = NEW.owner_id AND (w.events = 'all' OR NEW.status = 'failed');"""


def _when(extra: str) -> str:
    return f"NEW.status IN {ENDED} AND OLD.status NOT IN {ENDED} AND {extra}"


def upgrade() -> None:
    op.create_table(
        "webhooks",
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column("user_id", sa.Integer(), sa.ForeignKey("users.id", ondelete="CASCADE"), nullable=False),
        sa.Column("url", sa.String(2000), nullable=False),
        sa.Column("events", sa.String(16), nullable=False, server_default="all"),
        sa.Column("secret", sa.String(100), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
    )
    op.create_index("ix_webhooks_user_id", "webhooks", ["user_id"])
    big = sa.BigInteger().with_variant(sa.Integer(), "sqlite")
    op.create_table(
        "webhook_deliveries",
        sa.Column("id", big, primary_key=True, autoincrement=True),
        sa.Column(
            "webhook_id", sa.Integer(), sa.ForeignKey("webhooks.id", ondelete="CASCADE"), nullable=False
        ),
        sa.Column("event", sa.String(32), nullable=False),
        sa.Column("object_id", sa.Integer(), nullable=False),
        sa.Column("status", sa.String(20), nullable=False),
        sa.Column("state", sa.String(12), nullable=False, server_default="pending"),
        sa.Column("attempts", sa.Integer(), nullable=False, server_default="0"),
        sa.Column("body", sa.Text(), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("next_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("lease_until", sa.DateTime(timezone=True), nullable=True),
        sa.Column("delivered_at", sa.DateTime(timezone=True), nullable=True),
    )
    op.create_index("ix_webhook_deliveries_webhook_id", "webhook_deliveries", ["webhook_id"])
    op.create_index("ix_webhook_deliveries_due", "webhook_deliveries", ["state", "next_at"])
    op.create_table(
        "webhook_attempts",
        sa.Column("id", big, primary_key=True, autoincrement=True),
        sa.Column(
            "delivery_id",
            big,
            sa.ForeignKey("webhook_deliveries.id", ondelete="CASCADE"),
            nullable=False,
        ),
        sa.Column("at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("status_code", sa.Integer(), nullable=True),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("seconds", sa.Float(), nullable=False, server_default="0"),
    )
    op.create_index("ix_webhook_attempts_delivery_id", "webhook_attempts", ["delivery_id"])

    if op.get_bind().dialect.name == "sqlite":
        # SQLAlchemy's SQLite DateTime text, microseconds included (%f gives milliseconds)
        now = "strftime('%Y-%m-%d %H:%M:%f000', 'now')"
        for table, event, extra in SOURCES:
            op.execute(
                f"CREATE TRIGGER notify_{table}_ended AFTER UPDATE OF status ON {table} "
                f"FOR EACH ROW WHEN {_when(extra)} BEGIN {_insert(event, now)} END"
            )
    else:
        now = "clock_timestamp()"
        for table, event, extra in SOURCES:
            op.execute(
                f"CREATE FUNCTION notify_{table}_ended() RETURNS trigger LANGUAGE plpgsql AS $$ "
                f"BEGIN {_insert(event, now)} RETURN NULL; END $$"
            )
            op.execute(
                f"CREATE TRIGGER notify_{table}_ended AFTER UPDATE OF status ON {table} "
                f"FOR EACH ROW WHEN ({_when(extra)}) EXECUTE FUNCTION notify_{table}_ended()"
            )


def downgrade() -> None:
    sqlite = op.get_bind().dialect.name == "sqlite"
    for table, _event, _extra in SOURCES:
        op.execute(f"DROP TRIGGER IF EXISTS notify_{table}_ended" + ("" if sqlite else f" ON {table}"))
        if not sqlite:
            op.execute(f"DROP FUNCTION IF EXISTS notify_{table}_ended()")
    op.drop_table("webhook_attempts")
    op.drop_table("webhook_deliveries")
    op.drop_table("webhooks")
