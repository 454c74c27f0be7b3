"""What the scheduler keeps between ticks besides the queue (core/queue_cache.py has its own
tests): the workers' inventories (core/scheduler.py Fleet), the selection batches' group shapes
(db/scheduling.py GroupShapes) and the jobs' needs (core/scheduler.py _Needs). Each is changed
behind the scheduler's back, on a real database (SQLite and Postgres), and the next tick sees it;
and a tick runs with Python's cyclic collector paused (core/scheduler_loop.py collector_paused)."""

from __future__ import annotations

import gc
from typing import Any

from sqlalchemy import update

from core.scheduler import _Needs, read_state
from core.scheduler_loop import Scheduler, collector_paused
from core.settings import Settings
from db import jobs as dbj
from db import scheduling as dbs
from db import selections as dbsel
from db.connection import session_for
from db.models import Job, Selection, WorkerBeat
from db.users import create_user
from tests.conftest import beat

SPEC = {
    "model": {"kind": "gpt", "layers": 1, "d_model": 16, "heads": 1, "seq_len": 8, "vocab_size": 64},
    "train": {"steps": 1, "batch_size": 2},
}


class Sent:
    def __init__(self) -> None:
        self.jobs: list[int] = []
        self.groups: list[list[int]] = []
        self.collector_on: list[bool] = []

    def job(self, _settings: Settings, **kw: Any) -> None:
        self.jobs.append(kw["job_id"])
        self.collector_on.append(gc.isenabled())

    def group(self, _settings: Settings, **kw: Any) -> None:
        self.groups.append(list(kw["trial_ids"]))


def _sched(url: str, sent: Sent) -> Scheduler:
    return Scheduler(Settings(database_url=url, worker_alive_s=3600), send=sent.job, send_group=sent.group)


def _job(url: str, *, ranks: int) -> int:
    with session_for(url) as s:
        return dbj.create_job(s, name="j", spec=SPEC, world_size=ranks).id


def test_a_workers_changed_heartbeat_is_seen_on_the_next_tick(db_url: str) -> None:
    """The fleet keeps each worker's Box by its heartbeat's text: a heartbeat rewritten (here by
    plain SQL, as another process's) to fewer slots, or to draining, changes the next tick."""
    beat(db_url, "w1@h", slots=4, tasks=4)
    sent = Sent()
    sched = _sched(db_url, sent)
    sched.tick()
    assert [(k, b.slots if b else None) for k, (_, _, b) in sched.fleet.seen.items()] == [("w1@h", 4)]
    with session_for(db_url) as s:
        devices = s.get(WorkerBeat, "w1@h").devices  # type: ignore[union-attr]
        host = {**devices["host"], "slots": 1}
        s.execute(update(WorkerBeat).values(devices={**devices, "host": host}))
        s.commit()
    wide = _job(db_url, ranks=2)
    d = sched.tick()
    assert d is not None and d.placements == []
    assert "no live worker" in d.reasons[wide] and "largest worker: 1 slots" in d.reasons[wide]
    with session_for(db_url) as s:
        s.execute(update(WorkerBeat).values(devices={**devices, "host": {**host, "slots": 4}}))
        s.commit()
    d = sched.tick()
    assert d is not None and [w.id for w, _ in d.placements] == [wide]
    with session_for(db_url) as s:
        s.execute(update(WorkerBeat).values(devices={**devices, "host": {**host, "draining": True}}))
        s.commit()
    late = _job(db_url, ranks=1)
    d = sched.tick()
    assert d is not None and d.placements == [] and d.reasons[late].startswith("no live worker")


def test_a_batchs_rewritten_request_is_seen_on_the_next_tick(db_url: str) -> None:
    """The group shapes are kept by the request's text: a batch whose group_size is rewritten
    behind the scheduler's back is cut into groups of the new size at the next tick."""
    beat(db_url, "w1@h", slots=1, tasks=1)
    with session_for(db_url) as s:
        uid = create_user(s, name="gs").id
        sel = dbsel.create_selection(
            s,
            name="b",
            request={"group_size": 1, "devices": 1, "method": "grid"},
            metric="val_loss",
            mode="min",
            scheduler="shard-lrtf",
            owner_id=uid,
        )
        plans = [(i, {"train.lr": 0.001 * (i + 1)}, SPEC) for i in range(4)]
        trials = [
            t.id for t in dbsel.add_trials(s, selection_id=sel.id, plans=plans, queue="cpu", owner_id=uid)
        ]
        sel_id = sel.id
    shapes = dbs.GroupShapes()
    with session_for(db_url) as s:
        assert [g.trial_ids for g in dbs.queued_groups(s, shapes=shapes)] == [[t] for t in trials]
        s.execute(
            update(Selection)
            .where(Selection.id == sel_id)
            .values(request={"group_size": 3, "devices": 1, "method": "grid"})
        )
        s.commit()
        assert [g.trial_ids for g in dbs.queued_groups(s, shapes=shapes)] == [trials[:3], trials[3:]]
    sent = Sent()
    sched = _sched(db_url, sent)
    sched.tick()
    assert sent.groups == [trials[:3]]
    with session_for(db_url) as s:
        s.execute(
            update(Selection)
            .where(Selection.id == sel_id)
            .values(request={"group_size": 3, "devices": 2, "method": "grid"})
        )
        s.commit()
    d = sched.tick()
    assert d is not None and d.placements == []
    assert "no live worker can hold this selection group (2 device slot(s)" in d.reasons[d.order[0].id]


def test_the_needs_cache_drops_the_job_asked_for_longest_ago(db_url: str) -> None:
    """Past its bound the needs cache lets go of the jobs asked for least recently, not of every
    job but the last call's: a tick asks for the running jobs and the groups' trials each time and
    for a queued job only once, so dropping all but one call's ids read their specs again."""
    ids = [_job(db_url, ranks=1) for _ in range(4)]
    needs = _Needs(limit=3)
    read: list[list[int]] = []
    real = dbs.specs_of

    def counted(session: Any, job_ids: Any) -> Any:
        job_ids = list(job_ids)
        read.append(job_ids)
        return real(session, job_ids)

    dbs.specs_of = counted  # type: ignore[assignment]
    try:
        with session_for(db_url) as s:
            assert set(needs.get(s, ids[:3])) == set(ids[:3])
            needs.get(s, ids[1:3])  # asked again: the first is now the oldest asked
            assert set(needs.get(s, ids[3:])) == {ids[3]}
            assert len(needs.cache) == 3
            needs.get(s, ids[1:])
            assert read == [ids[:3], [], [ids[3]], []]
            needs.get(s, ids[:1])
            assert read[-1] == ids[:1]
    finally:
        dbs.specs_of = real  # type: ignore[assignment]


def test_a_tick_runs_with_the_collector_paused(db_url: str) -> None:
    """The cyclic collector is off while a tick decides and sends, on again after it (and left
    off when it was off before)."""
    beat(db_url, "w1@h", slots=2, tasks=2)
    sent = Sent()
    sched = _sched(db_url, sent)
    _job(db_url, ranks=1)
    assert gc.isenabled()
    sched.tick()
    assert sent.collector_on == [False] and gc.isenabled()
    gc.disable()
    try:
        with collector_paused():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_the_queues_fingerprint_holds_ids_whose_squares_pass_32_bits(db_url: str) -> None:
    """The queue's fingerprint sums the squares of the queued ids: with ids past 46,340 (a
    database of 100,000 jobs) those pass a 32-bit integer, which PostgreSQL's integer product
    refused."""
    with session_for(db_url) as s:
        s.add(Job(id=100_000, name="j", spec=SPEC, world_size=1))
        s.commit()
        n, ids, squares, _ = dbs.queued_fingerprint(s)
    assert (n, ids, squares) == (1, 100_000, 10**10)


def test_running_jobs_without_a_reservation_are_read_with_the_recent_usage(db_url: str) -> None:
    """A tick reads the running jobs once, for fair share and for those that hold no reservation
    (db/scheduling.py running_and_recent): a job set running on a worker behind the scheduler's
    back (no reservation) takes that worker's slot and counts against its owner's quota on the next
    tick; a running job the scheduler reserved is counted once, not again as a loose one; and the
    state the tick read equals a fresh read_state."""
    beat(db_url, "w1@h", slots=3, tasks=3)
    with session_for(db_url) as s:
        ann = create_user(s, name="ann", max_running_jobs=2).id
        loose = dbj.create_job(s, name="j", spec=SPEC, owner_id=ann).id
    sent = Sent()
    sched = _sched(db_url, sent)
    sched.tick()
    assert sent.jobs == [loose]
    with session_for(db_url) as s:  # claimed and run; then its reservation freed, still running
        s.execute(
            update(Job)
            .where(Job.id == loose)
            .values(status="running", started_at=dbj.db_now(s), worker="w1@h")
        )
        s.execute(dbs.delete(dbs.Reservation).where(dbs.Reservation.job_id == loose))
        s.commit()
        reserved, quota_bound = (dbj.create_job(s, name="j", spec=SPEC, owner_id=ann).id for _ in range(2))
    d = sched.tick()
    assert d is not None and [w.id for w, _ in d.placements] == [reserved]
    assert "quota: 2 of ann's jobs are running" in d.reasons[quota_bound]
    with session_for(db_url) as s:
        s.execute(update(Job).where(Job.id == reserved).values(status="running", started_at=dbj.db_now(s)))
        s.commit()
        st = read_state(s, sched.settings, _Needs())
    # ann runs two jobs (one reserved, one loose), one slot each: counted once each
    assert st.running_slots == {ann: 2} and st.quotas[ann].running == 2
    assert [b.free_slots for b in st.boxes] == [1]  # the loose job's slot taken too
    with session_for(db_url) as s:
        s.execute(update(Job).where(Job.id == loose).values(status="succeeded", finished_at=dbj.db_now(s)))
        s.commit()
    d = sched.tick()
    assert d is not None and [w.id for w, _ in d.placements] == [quota_bound]
