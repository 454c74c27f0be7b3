"""jobs: a trigram index on name (PostgreSQL), for the jobs listing's search by name

A search by name (`name contains`) matches a substring in any case: without an index it reads all
100,000 names of a busy team's jobs (61-86 ms a page on PostgreSQL, bench/scale.py). pg_trgm's GIN
index answers `name ILIKE '%...%'` from the trigrams. SQLite has no such index; its search
reads ix_jobs_listing (migration 0015), and gets a plain index of the same name on name, so the two
databases keep one schema (db/models.py).
"""

from alembic import op

revision, down_revision = "0017", "0016"


def upgrade() -> None:
    if op.get_bind().dialect.name != "postgresql":
        op.create_index("ix_jobs_name_trgm", "jobs", ["name"])
        return
    # pg_trgm is a trusted extension (PostgreSQL 13+): the database's owner may create it
    op.execute("CREATE EXTENSION IF NOT EXISTS pg_trgm")
    op.execute("CREATE INDEX ix_jobs_name_trgm ON jobs USING gin (name gin_trgm_ops)")


def downgrade() -> None:
    op.drop_index("ix_jobs_name_trgm", table_name="jobs")
