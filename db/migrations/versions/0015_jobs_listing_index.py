"""jobs: ix_jobs_listing (status, kind, owner_id, name), for the jobs table's counts and name search

The jobs listing counts every match of its filters for the page's "1-50 of N". Without it a count
read every job's row (specs and all: 100,000 jobs, 40-100 ms on SQLite, bench/scale.py); with it a
count reads this narrow index alone, and a search by name scans it instead of the table.
"""

from alembic import op

revision, down_revision = "0015", "0014"


def upgrade() -> None:
    op.create_index("ix_jobs_listing", "jobs", ["status", "kind", "owner_id", "name"])


def downgrade() -> None:
    op.drop_index("ix_jobs_listing", table_name="jobs")
