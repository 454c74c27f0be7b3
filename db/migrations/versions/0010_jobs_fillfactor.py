"""jobs: fillfactor 70 on PostgreSQL, so that rewriting a queued job's wait_reason is a HOT update

The scheduler rewrites the wait reason of every job waiting behind the blocked job each time that
job changes (about one tick in four with 1,000 queued jobs on a full fleet: bench/sched.py). On
full pages every such UPDATE wrote a new row version elsewhere plus an entry in each of the jobs
indexes, and the dead entries piled up under `ix_jobs_status = 'queued'` that every tick scans:
about 50 ms for 986 rows. With room left on each page the new version stays on its page and no
index changes (no indexed column does): about 4-9 ms. Lease renewals and progress writes gain
the same way. SQLite has no such setting.

Existing pages keep their packing until rewritten (VACUUM FULL jobs, or pg_repack); new pages
get the room at once. Not done here: VACUUM FULL locks the table for its whole run.
"""

from alembic import op

revision, down_revision = "0010", "0009"


def upgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.execute("ALTER TABLE jobs SET (fillfactor = 70)")


def downgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.execute("ALTER TABLE jobs RESET (fillfactor)")
