"""Data functions against a real SQLite file migrated by Alembic."""

from __future__ import annotations

import threading

import pytest

from db import jobs as dbj
from db import workers as dbw
from db.connection import get_engine, session_for
from tests.conftest import together


def _job(url: str, **kw) -> int:
    with session_for(url) as s:
        return dbj.create_job(s, name="j", spec={"train": {"steps": 3}}, steps=3, **kw).id


def test_sqlite_runs_in_wal_mode_and_postgres_is_postgres(db_url: str) -> None:
    with get_engine(db_url).connect() as c:
        if db_url.startswith("sqlite"):
            assert c.exec_driver_sql("PRAGMA journal_mode").scalar() == "wal"
        else:
            assert c.exec_driver_sql("SELECT version()").scalar().startswith("PostgreSQL")


def test_claim_is_won_by_exactly_one_of_many_racing_workers(db_url: str) -> None:
    job_id = _job(db_url)
    wins: list[str] = []
    barrier = threading.Barrier(8)

    def race(name: str) -> None:
        with session_for(db_url) as s:
            barrier.wait()
            if dbj.claim_job(s, job_id=job_id, owner=name, worker=name, lease_s=30):
                wins.append(name)

    together(race, (f"w{i}" for i in range(8)))
    assert len(wins) == 1
    with session_for(db_url) as s:
        job = dbj.get_job(s, job_id)
        assert (job.status, job.worker, job.attempts) == ("running", wins[0], 1)


def test_cancel_of_queued_job_is_immediate_and_blocks_claims(db_url: str) -> None:
    job_id = _job(db_url)
    with session_for(db_url) as s:
        assert dbj.request_cancel(s, job_id=job_id).status == "cancelled"
        assert not dbj.claim_job(s, job_id=job_id, owner="w", worker="w", lease_s=30)
        with pytest.raises(dbj.Conflict, match="already cancelled"):
            dbj.request_cancel(s, job_id=job_id)


def test_cancel_of_running_job_only_sets_the_flag(db_url: str) -> None:
    job_id = _job(db_url)
    with session_for(db_url) as s:
        assert dbj.claim_job(s, job_id=job_id, owner="w", worker="w", lease_s=30)
        job = dbj.request_cancel(s, job_id=job_id)
        assert job.status == "running" and job.cancel_requested
        assert dbj.cancel_requested(s, job_id=job_id)


def test_stale_queued_jobs_are_found_for_the_reconciler(db_url: str) -> None:
    job_id = _job(db_url)
    with session_for(db_url) as s:
        assert [j.id for j in dbj.stale_queued_jobs(s, older_than_s=-1)] == [job_id]
        dbj.mark_enqueued(s, job_ids=[job_id])
        assert dbj.stale_queued_jobs(s, older_than_s=60) == []


def test_heartbeats_and_liveness(db_url: str) -> None:
    with session_for(db_url) as s:
        dbw.record_heartbeat(s, name="w1", hostname="h", queues=["cpu"], devices=[{"type": "cpu"}])
        assert [w.name for w in dbw.live_workers(s, within_s=30)] == ["w1"]
        assert dbw.live_workers(s, within_s=-1) == []


def test_migrations_match_the_models(db_url: str) -> None:
    """Alembic's autogenerate finds nothing to add: the migrations create exactly the tables."""
    from alembic.autogenerate import compare_metadata
    from alembic.migration import MigrationContext

    from db.models import Base

    with get_engine(db_url).connect() as c:
        diff = compare_metadata(MigrationContext.configure(c), Base.metadata)
    assert diff == []


def test_every_migration_goes_down_and_up_again_to_the_same_schema(db_url: str) -> None:
    """Down to before the first revision and back to the head: each revision's downgrade undoes its
    upgrade (a column left behind, or a drop of one never added, fails here)."""
    import sqlalchemy as sa
    from alembic import command
    from alembic.autogenerate import compare_metadata
    from alembic.migration import MigrationContext

    from db.migrate import alembic_config
    from db.models import Base

    def schema() -> dict[str, list[str]]:
        inspector = sa.inspect(get_engine(db_url))
        return {t: sorted(c["name"] for c in inspector.get_columns(t)) for t in inspector.get_table_names()}

    at_head = schema()
    command.downgrade(alembic_config(db_url), "base")
    assert set(schema()) <= {"alembic_version"}
    command.upgrade(alembic_config(db_url), "head")
    assert schema() == at_head
    with get_engine(db_url).connect() as c:
        assert compare_metadata(MigrationContext.configure(c), Base.metadata) == []
