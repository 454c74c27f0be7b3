"""api/queue.py keeps the queued jobs between orderings (as the scheduler does, core/queue_cache.py)
and reads again only what changed: its positions stay those of core/scheduler.py queue_positions
on a full read of the same database, after submits (of several users and priorities), cancels, a
job taken off the queue by a reservation, and a priority changed in place (which no job's version
shows). Real SQLite and PostgreSQL."""

from __future__ import annotations

import random

from sqlalchemy import update

from api import queue
from core.scheduler import queue_positions
from core.settings import Settings
from db import jobs as dbj
from db.connection import session_for
from db.models import Job
from db.queue_view import queued_priorities
from db.users import create_user

SPEC = {"model": {"kind": "mlp", "layers": 1, "d_model": 16, "seq_len": 8}, "train": {"steps": 9}}


def _same_as_a_full_read(url: str, settings: Settings) -> dict[int, int]:
    with session_for(url) as s:
        kept = [(w.id, w.eff) for w in queue.queue_positions(s, settings)]
        fresh = [(w.id, w.eff) for w in queue_positions(s, settings)]
        assert kept == fresh
        # the listing's positions are worked out afresh from the kept jobs (not an older answer)
        queue._DIRTY.add(url)
        _, where = queue.positions(s, settings)
        assert where == {job_id: i + 1 for i, (job_id, _) in enumerate(fresh)}
        return where


def test_kept_positions_follow_submits_cancels_and_priority_changes(db_url: str) -> None:
    settings = Settings(database_url=db_url)
    queue._KEPT.pop(db_url, None)
    rng = random.Random(7)
    with session_for(db_url) as s:
        users = [create_user(s, name=f"u{i}").id for i in range(3)]
    jobs: list[int] = []

    def submit(n: int) -> None:
        with session_for(db_url) as s:
            for _ in range(n):
                jobs.append(
                    dbj.create_job(
                        s,
                        name="j",
                        spec=SPEC,
                        priority=rng.choice([0, 0, 1, 3]),
                        owner_id=rng.choice(users),
                        world_size=rng.choice([1, 2]),
                    ).id
                )

    submit(30)
    before = _same_as_a_full_read(db_url, settings)
    submit(5)  # new jobs, among them ones that go ahead of older ones
    _same_as_a_full_read(db_url, settings)
    with session_for(db_url) as s:
        for job_id in jobs[3:9]:
            dbj.request_cancel(s, job_id=job_id, actor="test")
    after_cancel = _same_as_a_full_read(db_url, settings)
    assert len(after_cancel) == len(before) + 5 - 6

    # a priority changed in place: same job, same version; the last job goes first
    last = jobs[-1]
    with session_for(db_url) as s:
        s.execute(update(Job).where(Job.id == last).values(priority=9))
        s.commit()
    where = _same_as_a_full_read(db_url, settings)
    assert where[last] == 1

    # a job that leaves the queue and comes back (claimed, released: a new version)
    with session_for(db_url) as s:
        s.execute(update(Job).where(Job.id == jobs[0]).values(status="running"))
        s.commit()
    assert jobs[0] not in _same_as_a_full_read(db_url, settings)
    with session_for(db_url) as s:
        s.execute(update(Job).where(Job.id == jobs[0]).values(status="queued", attempts=Job.attempts + 1))
        s.commit()
    assert jobs[0] in _same_as_a_full_read(db_url, settings)


def test_the_priority_check_holds_a_product_past_32_bits(db_url: str) -> None:
    """priority x id passes a 32-bit integer for a priority-100 job past id 21,474,836, which
    PostgreSQL's integer product refuses: the check multiplies in 64 bits."""
    with session_for(db_url) as s:
        s.add(Job(id=30_000_000, name="j", spec={}, world_size=1, priority=100))
        s.commit()
        assert queued_priorities(s) == (100, 3_000_000_000)
