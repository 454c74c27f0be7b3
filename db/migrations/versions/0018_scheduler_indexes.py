"""jobs: ix_jobs_queued (the queue's versions) and indexes on started_at and finished_at (recent usage)

The incremental scheduler (core/queue_cache.py) reads every queued job's version each tick
(db/scheduling.py queued_versions: id, enqueued_at, attempts); ix_jobs_queued, partial on the queue's
rows, holds all of it, so the read takes one narrow index instead of 12,000 rows of specs
(bench/scale.py). A tick's fair-share usage (recent_usage) reads the running jobs and those started
or ended within the window: ix_jobs_started_at and ix_jobs_finished_at find those without reading
all 100,000 jobs.
"""

import sqlalchemy as sa
from alembic import op

revision, down_revision = "0018", "0017"


def upgrade() -> None:
    # partial: only the queue's rows, and no rival to ix_jobs_listing for the listing's counts
    op.create_index(
        "ix_jobs_queued",
        "jobs",
        ["id", "enqueued_at", "attempts"],
        sqlite_where=sa.text("status = 'queued' AND kind = 'job' AND cancel_requested IS 0"),
        postgresql_where=sa.text("status = 'queued' AND kind = 'job' AND cancel_requested IS false"),
    )
    op.create_index("ix_jobs_started_at", "jobs", ["started_at"])
    op.create_index("ix_jobs_finished_at", "jobs", ["finished_at"])


def downgrade() -> None:
    op.drop_index("ix_jobs_finished_at", table_name="jobs")
    op.drop_index("ix_jobs_started_at", table_name="jobs")
    op.drop_index("ix_jobs_queued", table_name="jobs")
