"""The incremental scheduler (core/queue_cache.py) decides as the full read and `plan` do: a
randomized run of submits, cancellations, ends and requeues on a real database (SQLite and
Postgres), each tick compared with `plan` on a fresh full read of the same state; and changes made
behind the scheduler's back (another process's writes) are seen at its next tick."""

from __future__ import annotations

import logging
import random
from typing import Any

import pytest
from sqlalchemy import select, update

from core.scheduler import Decision, _Needs, plan, read_state
from core.scheduler_loop import Scheduler
from core.settings import Settings
from db import jobs as dbj
from db import scheduling as dbs
from db.connection import session_for
from db.jobs import Attempt
from db.models import Job, JobStatus, Reservation, SchedulerLock
from db.users import create_user
from tests.conftest import beat

SPEC = {
    "model": {"kind": "gpt", "layers": 1, "d_model": 16, "heads": 1, "seq_len": 8, "vocab_size": 64},
    "train": {"steps": 1, "batch_size": 2},
}


class Sent:
    def __init__(self) -> None:
        self.jobs: list[int] = []

    def __call__(self, _settings: Settings, **kw: Any) -> None:
        self.jobs.append(kw.get("job_id", -1))


def _submit(url: str, rng: random.Random, users: list[int]) -> int:
    with session_for(url) as s:
        return dbj.create_job(
            s,
            name="j",
            spec=SPEC,
            priority=rng.choice([0, 0, 1, 3]),
            owner_id=rng.choice(users),
            world_size=rng.choice([1, 1, 2, 4]),
        ).id


def _expected(url: str, settings: Settings) -> Decision:
    """`plan` on everything read afresh (what the scheduler decided before it kept the queue)."""
    with session_for(url) as s:
        beats = dbs.workers_seen(s, within_s=settings.worker_alive_s)
        dbs.free_reservations(s, live={b.name for b in beats})
        st = read_state(s, settings, _Needs())
        s.rollback()
    return plan(
        st.wants,
        st.boxes,
        now=st.now,
        aging_s=settings.aging_s,
        running_slots=st.running_slots,
        recent=st.recent,
        quotas=st.quotas,
        running=st.running,
    )


def _stored_reasons(url: str) -> dict[int, str | None]:
    """The waiting (queued, unreserved) jobs' reasons in the database."""
    with session_for(url) as s:
        return dict(
            s.execute(  # type: ignore[arg-type]
                select(Job.id, Job.wait_reason).where(
                    Job.status == JobStatus.queued, Job.id.not_in(select(Reservation.job_id))
                )
            ).all()
        )


def _converged(url: str, settings: Settings) -> None:
    """Every waiting job's stored reason is the one `plan` gives it on a fresh full read now."""
    want = _expected(url, settings).reasons
    queued = _stored_reasons(url)
    assert {j: r for j, r in queued.items() if j in want} == {j: want[j] for j in queued if j in want}


def _check(url: str, sched: Scheduler) -> Decision:
    want = _expected(url, sched.settings)
    got = sched.tick()
    assert got is not None
    assert [(w.id, n) for w, n in got.placements] == [(w.id, n) for w, n in want.placements]
    assert got.reasons == want.reasons
    # once the tick has returned (its reasons are written in their own transaction after the
    # placements), the database holds the reasons `plan` gave
    queued = _stored_reasons(url)
    assert {j: r for j, r in queued.items() if j in want.reasons} == {
        j: want.reasons[j] for j in queued if j in want.reasons
    }
    return got


def _running(url: str) -> list[tuple[int, int, str | None]]:
    with session_for(url) as s:
        return [
            tuple(r)  # type: ignore[misc]
            for r in s.execute(
                select(Job.id, Job.attempts, Job.owner).where(Job.status == JobStatus.running)
            ).all()
        ]


def _claim_placed(url: str) -> None:
    with session_for(url) as s:
        rows = s.execute(
            select(Reservation.job_id, Reservation.worker).where(
                Reservation.claimed_at.is_(None), Reservation.node_rank == 0
            )
        ).all()
    with session_for(url) as s:
        for job_id, worker in rows:
            dbj.claim_job(s, job_id=job_id, owner=f"t:{job_id}", worker=worker, lease_s=3600, reserved=True)


def test_incremental_decisions_equal_the_full_reads(db_url: str) -> None:
    rng = random.Random(7)
    with session_for(db_url) as s:
        users = [create_user(s, name=f"u{i}", max_running_jobs=3).id for i in range(3)]
    for w in range(3):
        beat(db_url, f"w{w}@h", slots=4, tasks=2)
    sched = Scheduler(Settings(database_url=db_url, worker_alive_s=3600), send=Sent(), send_group=Sent())
    for _ in range(25):
        _submit(db_url, rng, users)
    for _ in range(30):
        _check(db_url, sched)
        _claim_placed(db_url)
        # and they converge: a tick with nothing new places nothing and leaves every waiting job's
        # stored reason the one `plan` gives on a fresh full read after it (the tick before may
        # not: a reason that counts free slots is worked out before the placements behind it)
        assert _check(db_url, sched).placements == []
        _converged(db_url, sched.settings)
        op = rng.random()
        if op < 0.4:
            for _ in range(rng.randint(1, 4)):
                _submit(db_url, rng, users)
        elif op < 0.6:
            with session_for(db_url) as s:
                queued = s.scalars(select(Job.id).where(Job.status == JobStatus.queued)).all()
                if queued:
                    dbj.request_cancel(s, job_id=rng.choice(queued))
        elif (running := _running(db_url)) and op < 0.9:
            job_id, attempt, owner = rng.choice(running)
            with session_for(db_url) as s:
                dbj.finish_job(s, attempt=Attempt(job_id, attempt, owner), status=JobStatus.succeeded)
        elif running:
            with session_for(db_url) as s:
                dbj.requeue_job(s, job_id=rng.choice(running)[0], reason="test")


def test_changes_behind_its_back_are_seen(db_url: str) -> None:
    """Another process inserts, cancels and takes jobs with plain SQL between two ticks: the next
    tick decides as a full read does. A wait reason rewritten behind its back is read again within
    QueueCache.FULL_S (0 here: every tick)."""
    rng = random.Random(3)
    with session_for(db_url) as s:
        users = [create_user(s, name=f"v{i}", max_running_jobs=3).id for i in range(2)]
    beat(db_url, "w1@h", slots=2, tasks=2)
    sched = Scheduler(Settings(database_url=db_url, worker_alive_s=3600), send=Sent(), send_group=Sent())
    jobs = [_submit(db_url, rng, users) for _ in range(12)]
    _check(db_url, sched)
    _claim_placed(db_url)
    waiting = [j for j in jobs if j not in {r[0] for r in _running(db_url)}]
    with session_for(db_url) as s:  # behind the scheduler's back
        s.execute(update(Job).where(Job.id == waiting[-1]).values(status=JobStatus.cancelled))
        s.execute(update(Job).where(Job.id == waiting[-2]).values(priority=0, attempts=1, status="running"))
        s.commit()
    jobs.append(_submit(db_url, rng, users))
    got = _check(db_url, sched)
    assert waiting[-1] not in got.reasons and waiting[-2] not in got.reasons
    with session_for(db_url) as s:
        s.execute(update(Job).where(Job.id == waiting[-2]).values(status=JobStatus.queued))
        s.execute(update(Job).where(Job.id == waiting[0]).values(wait_reason="someone else's words"))
        s.commit()
    sched.queue.FULL_S = 0.0
    got = _check(db_url, sched)
    assert waiting[-2] in got.reasons


def _fleet(url: str, name: str, jobs: int) -> tuple[Scheduler, Sent, list[int]]:
    """One worker of 2 slots, `jobs` one-rank jobs (the first places, the rest wait)."""
    with session_for(url) as s:
        users = [create_user(s, name=name).id]
    beat(url, "w1@h", slots=2, tasks=2)
    sent = Sent()
    sched = Scheduler(Settings(database_url=url, worker_alive_s=3600), send=sent, send_group=Sent())
    ids = []
    for _ in range(jobs):
        with session_for(url) as s:
            ids.append(dbj.create_job(s, name="j", spec=SPEC, priority=0, owner_id=users[0], world_size=2).id)
    return sched, sent, ids


def test_placements_stand_when_the_reasons_fail(
    db_url: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The reasons' transaction fails: the tick's placement is committed and sent all the same,
    the failure is logged, no reason is written, and the next tick writes them all."""
    sched, sent, jobs = _fleet(db_url, "fay", 4)
    real = dbs.set_wait_reasons

    def broken(_session: Any, _reasons: Any) -> None:
        raise RuntimeError("the database went away")

    monkeypatch.setattr(dbs, "set_wait_reasons", broken)
    with caplog.at_level(logging.ERROR, logger="core.scheduler_loop"):
        d = sched.tick()
    assert d is not None and [w.id for w, _ in d.placements] == [jobs[0]]
    assert sent.jobs == [jobs[0]]
    with session_for(db_url) as s:
        assert s.scalars(select(Reservation.job_id)).all() == [jobs[0]]
    assert "could not write 3 wait reason(s)" in caplog.text
    assert _stored_reasons(db_url) == dict.fromkeys(jobs[1:])
    monkeypatch.setattr(dbs, "set_wait_reasons", real)
    d = sched.tick()
    assert d is not None and d.placements == []
    assert _stored_reasons(db_url) == dict.fromkeys(jobs[1:], _busy())
    _converged(db_url, sched.settings)


def _busy() -> str:
    return (
        "workers busy: needs 2 free slot(s); most free now: 0 (the fleet can hold it once running jobs end)"
    )


def test_no_reasons_are_written_once_the_lock_has_lapsed(db_url: str) -> None:
    """Another scheduler takes the lock while a tick sends its placement (its lease lapsed): the
    placement stands (reserve's own transaction guards it), the reasons are not written, and the
    tick that leads again reads everything and writes them."""
    sched, sent, jobs = _fleet(db_url, "gus", 3)

    def steal(settings: Settings, **kw: Any) -> None:
        sent(settings, **kw)
        with session_for(db_url) as s:
            s.execute(update(SchedulerLock).values(holder="another"))
            s.commit()

    sched.send = steal
    d = sched.tick()
    assert d is not None and [w.id for w, _ in d.placements] == [jobs[0]] and sent.jobs == [jobs[0]]
    assert _stored_reasons(db_url) == dict.fromkeys(jobs[1:])
    assert not sched.leading
    sched.send = sent
    assert sched.tick() is None  # "another" holds the lock now
    with session_for(db_url) as s:
        dbs.release_lock(s, holder="another")
    assert sched.tick() is not None
    assert _stored_reasons(db_url) == dict.fromkeys(jobs[1:], _busy())
    _converged(db_url, sched.settings)
