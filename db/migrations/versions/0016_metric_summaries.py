"""metric_summaries: long metric series kept downsampled beside their points

A job page's chart asks for a job's series downsampled to 1,000 points; the first read of a job
with a million points read every one of them (2.9 s on SQLite, bench/scale.py). The API writes a
series of 100,000 points or more here, downsampled, after its first full read; later first reads
(another API process, a restart, an entry pushed out of the cache) read this and only the points
stored after it.
"""

import sqlalchemy as sa
from alembic import op

revision, down_revision = "0016", "0015"


def upgrade() -> None:
    op.create_table(
        "metric_summaries",
        sa.Column("job_id", sa.Integer(), sa.ForeignKey("jobs.id", ondelete="CASCADE"), primary_key=True),
        sa.Column("name", sa.String(64), primary_key=True),
        sa.Column("attempt", sa.Integer(), nullable=False),
        sa.Column("upto_id", sa.BigInteger(), nullable=False),
        sa.Column("points", sa.Integer(), nullable=False),
        sa.Column("steps", sa.LargeBinary(), nullable=False),
        sa.Column("values", sa.LargeBinary(), nullable=False),
    )


def downgrade() -> None:
    op.drop_table("metric_summaries")
