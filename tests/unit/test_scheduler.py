"""The scheduler's decisions (core/scheduler.py) on plain values, and its ticks against a real
database (SQLite and Postgres, migrated by Alembic) with heartbeats written as workers write them.
The broker is replaced by a recorder of what would be sent: these tests are about placement; the
integration tests (tests/integration/test_scheduler.py) run real workers."""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from typing import Any

import pytest
from sqlalchemy import event, update

from core import scheduler_loop
from core.scheduler import Box, Quota, Running, Want, gang_shape, order_queue, plan
from core.scheduler_loop import WAKE_GAP_S, Scheduler
from core.settings import Settings
from db import ingest as dbi
from db import jobs as dbj
from db import scheduling as dbs
from db.connection import get_engine, session_for
from db.models import Job, JobStatus, Reservation, WorkerBeat
from db.users import create_user
from tests.conftest import beat, together

GiB = 2**30


def box(name: str, slots: int = 2, tasks: int = 2, **kw: Any) -> Box:
    return Box(
        name=name,
        queues=frozenset({"cpu", "gpu"}),
        slots=slots,
        tasks=tasks,
        gpus=kw.get("gpus", 0),
        ram=kw.get("ram", 64 * GiB),
    )


def want(
    i: int, *, user: int | None = 1, priority: int = 0, created: float | None = None, ranks: int = 1
) -> Want:
    return Want(
        id=i, user=user, priority=priority, created=float(i) if created is None else created, ranks=ranks
    )


def decide(wants: list[Want], boxes: list[Box], **kw: Any) -> Any:
    kw.setdefault("now", 1000.0)
    kw.setdefault("aging_s", 600.0)
    kw.setdefault("running_slots", {})
    kw.setdefault("recent", {})
    kw.setdefault("quotas", {})
    return plan(wants, boxes, **kw)


# ---- ordering -----------------------------------------------------------------------------------


def test_priority_first_then_age() -> None:
    jobs = [want(i) for i in range(1, 11)] + [want(11, priority=5)]
    order = order_queue(jobs, now=100.0, aging_s=600.0, running_slots={}, recent={})
    assert [w.id for w in order] == [11, *range(1, 11)]


def test_aging_lifts_a_starving_job_over_newer_higher_priority_ones() -> None:
    old = want(1, priority=0, created=0.0)
    new = want(2, priority=2, created=2990.0)
    # waited 3000 s with aging_s 1000: effective 0 + 3 = 3 > 2
    order = order_queue([new, old], now=3000.0, aging_s=1000.0, running_slots={}, recent={})
    assert [w.id for w in order] == [1, 2] and order[0].eff == 3
    # before it has waited long enough it stays behind
    order = order_queue([new, old], now=2995.0, aging_s=1500.0, running_slots={}, recent={})
    assert [w.id for w in order] == [2, 1]


def test_fair_share_alternates_users_and_counts_what_runs_and_recent_use() -> None:
    a = [want(i, user=1) for i in (1, 2, 3)]
    b = [want(i, user=2) for i in (4, 5, 6)]
    order = order_queue(a + b, now=100.0, aging_s=600.0, running_slots={}, recent={})
    assert [w.user for w in order] == [1, 2, 1, 2, 1, 2]
    # user 1 has two slots running now: user 2 goes first until they are even
    order = order_queue(a + b, now=100.0, aging_s=600.0, running_slots={1: 2}, recent={})
    assert [w.user for w in order] == [2, 2, 1, 2, 1, 1]
    # equal running slots: the one with fewer recent slot-minutes first, then the one served
    # longest ago
    order = order_queue(
        a + b, now=100.0, aging_s=600.0, running_slots={}, recent={1: (3, 50.0), 2: (1, 90.0)}
    )
    assert [w.user for w in order][:2] == [2, 1]
    order = order_queue(
        a + b, now=100.0, aging_s=600.0, running_slots={}, recent={1: (1, 50.0), 2: (1, 40.0)}
    )
    assert [w.user for w in order][:2] == [2, 1]


# ---- placement ----------------------------------------------------------------------------------


def test_high_priority_job_goes_next_and_lower_ones_wait_behind_it() -> None:
    boxes = [box("w1", slots=2, tasks=1), box("w2", slots=2, tasks=1)]
    for b in boxes:  # both busy
        b.take(2, 0, 0)
    d = decide([*(want(i) for i in range(1, 11)), want(11, priority=5)], boxes)
    assert d.placements == []
    assert d.reasons[11].startswith("workers busy: needs")
    assert all(d.reasons[i] == "behind higher-priority job 11" for i in range(1, 11))
    # one frees: the high-priority job takes it
    boxes[0].free_slots, boxes[0].free_tasks = 2, 1
    d = decide([*(want(i) for i in range(1, 11)), want(11, priority=5)], boxes)
    assert [(w.id, n) for w, n in d.placements] == [(11, [("w1", 1, 0, 0)])]


def test_wait_reasons_tell_busy_from_too_small_quota_and_no_worker() -> None:
    """The one worker simply busy used to read "no worker big enough now"; each cause now has its
    own words (this test fails on the old message)."""
    quotas = {1: Quota(name="ann", limits={"running_jobs": 1, "ranks": 8, "gpus": 0}, running=1, ranks=1)}
    boxes = [box("w1", slots=2, tasks=2)]
    boxes[0].take(2, 0, 0)
    d = decide([want(1, user=2), want(2, user=2, ranks=8), want(3, user=1)], boxes, quotas=quotas)
    busy, small, quota = d.reasons[1], d.reasons[2], d.reasons[3]
    assert (
        busy
        == "workers busy: needs 1 free slot(s); most free now: 0 (the fleet can hold it once running jobs end)"
    )
    assert small.startswith("no live worker, nor a gang of equal shares, can hold 8 rank(s)")
    assert quota.startswith("quota: 1 of ann's jobs are running")
    assert decide([want(4)], []).reasons[4] == "no live worker: waiting for one to start"


def test_a_worker_with_free_slots_but_no_free_task_says_so() -> None:
    """The demo's worker (8 slots, one task at once) running the demo job: the next job used to
    read "needs 1 free slot(s); most free now: 7", which contradicts itself."""
    boxes = [box("worker1@host", slots=8, tasks=1)]
    boxes[0].take(1, 0, 0)
    reason = decide([want(2)], boxes).reasons[2]
    assert reason == (
        "workers busy: needs 1 free slot(s) and a free task; worker worker1@host has 7 free slot(s) "
        "but it runs 1 job(s) already, the most it runs at once (its --concurrency is 1) (the fleet "
        "can hold it once running jobs end)"
    )
    assert "most free now" not in reason
    # GPUs or host memory short on a worker with slots: named too
    gpu = [box("g", slots=8, tasks=4, gpus=1)]
    gpu[0].take(1, 1, 0)
    w = Want(id=3, user=1, priority=0, created=3.0, ranks=1, gpus=1)
    assert "0 of the 1 GPU(s) needed are free" in decide([w], gpu).reasons[3]
    # slots short: the old words, which are true then
    full = [box("w", slots=2, tasks=4)]
    full[0].take(2, 0, 0)
    assert (
        decide([want(4)], full).reasons[4].startswith("workers busy: needs 1 free slot(s); most free now: 0")
    )


def test_a_busy_reason_is_worked_out_once_per_ask_until_a_placement(monkeypatch: Any) -> None:
    """busy_reason scans every worker; a queue of thousands of jobs of a few shapes asks it once
    per shape, and again after a placement changed what is free (the words must stay true)."""
    import core.scheduler as cs

    calls: list[int] = []
    real = cs.busy_reason

    def counted(w: Want, n: int, boxes: list[Box]) -> str:
        calls.append(w.id)
        return real(w, n, boxes)

    monkeypatch.setattr(cs, "busy_reason", counted)
    boxes = [box("w1", slots=4, tasks=8)]
    boxes[0].take(2, 0, 0)  # 2 free
    wide = [want(i, ranks=4, created=900.0) for i in range(1, 501)]
    d = decide(wide, boxes)
    assert len(calls) == 1 and {d.reasons[i] for i in range(1, 501)} == {
        "workers busy: needs 4 free slot(s); most free now: 2 (the fleet can hold it once running jobs end)"
    }
    calls.clear()
    boxes = [box("w1", slots=4, tasks=8)]
    boxes[0].take(2, 0, 0)
    # the 1-rank job fills a gap between two 4-rank jobs: the second one's words see 1 free slot
    d = decide([want(1, ranks=4), want(2, ranks=1), want(3, ranks=4)], boxes)
    assert [w.id for w, _ in d.placements] == [2]
    assert "most free now: 2" in d.reasons[1] and "most free now: 1" in d.reasons[3]
    assert calls == [1, 3]


def test_equal_priority_jobs_fill_gaps_but_lower_ones_do_not() -> None:
    boxes = [box("w1", slots=2, tasks=4)]
    boxes[0].take(1, 0, 0)  # one slot free
    d = decide([want(1, ranks=2), want(2, ranks=1), want(3, priority=-1, ranks=1)], boxes)
    assert [w.id for w, _ in d.placements] == [2]  # backfill at equal effective priority
    assert d.reasons[3] == "behind higher-priority job 1"


def test_quota_and_never_fits_do_not_block_others() -> None:
    boxes = [box("w1", slots=4, tasks=4)]
    quotas = {1: Quota(name="ann", limits={"running_jobs": 1, "ranks": 8, "gpus": 0}, running=1, ranks=1)}
    d = decide(
        [want(1, user=1, priority=9), want(2, user=2, ranks=16), want(3, user=2)], boxes, quotas=quotas
    )
    assert d.reasons[1] == "quota: 1 of ann's jobs are running, the quota is 1"
    assert "no live worker, nor a gang of equal shares, can hold 16 rank(s)" in d.reasons[2]
    assert [w.id for w, _ in d.placements] == [3]


def test_quota_counts_placements_within_one_tick() -> None:
    quotas = {1: Quota(name="bo", limits={"running_jobs": 2, "ranks": 64, "gpus": 0})}
    d = decide([want(i) for i in (1, 2, 3)], [box("w1", slots=8, tasks=8)], quotas=quotas)
    assert [w.id for w, _ in d.placements] == [1, 2]
    assert d.reasons[3].startswith("quota: 2 of bo's jobs are running")


def test_no_live_worker_is_a_reason() -> None:
    d = decide([want(1)], [])
    assert d.reasons == {1: "no live worker: waiting for one to start"}


def test_a_job_wider_than_any_worker_gets_a_gang_of_equal_shares() -> None:
    boxes = [box("w1", slots=2), box("w2", slots=2), box("w3", slots=3)]
    assert gang_shape(want(1, ranks=3), boxes) == 1
    assert gang_shape(want(1, ranks=4), boxes) == 2
    assert gang_shape(want(1, ranks=6), boxes) == 3
    assert gang_shape(want(1, ranks=5), boxes) is None  # 5 ranks split evenly over 5 nodes: 3 workers
    d = decide([want(1, ranks=4)], boxes)
    (w, nodes) = d.placements[0]
    assert sorted(n[0] for n in nodes) == ["w1", "w2"] and all(n[1] == 2 for n in nodes)
    # busy: it waits for two workers with two free slots each
    boxes = [box("w1", slots=2), box("w2", slots=2)]
    boxes[1].take(1, 0, 0)
    d = decide([want(1, ranks=4)], boxes)
    assert (
        d.reasons[1]
        == "workers busy: needs 2 free slot(s) on each of 2 workers; most free now: 2 (the fleet can hold it once running jobs end)"
    )


def test_host_memory_decides_as_slots_do() -> None:
    boxes = [box("w1", slots=8, ram=4 * GiB), box("w2", slots=8, ram=16 * GiB)]
    w = Want(id=1, user=None, priority=0, created=0.0, ranks=1, ram=8 * GiB)
    d = decide([w], boxes)
    assert d.placements[0][1] == [("w2", 1, 0, 8 * GiB)]


def test_preemption_picks_the_fewest_lower_priority_jobs_on_one_worker() -> None:
    boxes = [box("w1", slots=2, tasks=2), box("w2", slots=2, tasks=2)]
    for b in boxes:
        b.take(1, 0, 0)
        b.take(1, 0, 0)
    running = [
        Running(10, 0, "w1", 1, 0, 0),
        Running(11, 0, "w1", 1, 0, 0),
        Running(12, 0, "w2", 1, 0, 0),
        Running(13, 9, "w2", 1, 0, 0),
    ]
    d = decide([want(1, priority=5, ranks=1)], boxes, running=running, preemption=True)
    assert d.preempt in ([10], [11], [12]) and d.preempt_for == 1
    d = decide([want(1, priority=5, ranks=2)], boxes, running=running, preemption=True)
    assert d.preempt == [10, 11]  # w2 has a higher-priority job
    assert decide([want(1, priority=5, ranks=2)], boxes, running=running).preempt == []  # off
    pending = [*running[:3], Running(13, 9, "w2", 1, 0, 0, preempt_requested=True)]
    assert decide([want(1, priority=5)], boxes, running=pending, preemption=True).preempt == []


def test_a_waiting_gang_preempts_on_as_many_workers_as_it_needs() -> None:
    # three 2-slot workers, all full; a 4-rank job needs a gang of two, so two workers must be
    # cleared: the two whose lower-priority jobs are fewest, never the one running a higher one
    boxes = [box("w1", slots=2, tasks=2), box("w2", slots=2, tasks=2), box("w3", slots=2, tasks=2)]
    running = [
        Running(10, 0, "w1", 2, 0, 0),
        Running(11, 0, "w2", 1, 0, 0),
        Running(12, 0, "w2", 1, 0, 0),
        Running(13, 9, "w3", 2, 0, 0),
    ]
    for r in running:
        next(b for b in boxes if b.name == r.box).take(r.slots, 0, 0)
    d = decide([want(1, priority=5, ranks=4)], boxes, running=running, preemption=True)
    assert d.preempt_for == 1 and sorted(d.preempt) == [10, 11, 12]
    assert d.reasons[1].endswith("preempting job(s) 10, 11, 12"), d.reasons[1]
    # a worker with room already costs nothing: only one other worker is cleared
    boxes = [box("w1", slots=2, tasks=2), box("w2", slots=2, tasks=2), box("w3", slots=2, tasks=2)]
    boxes[0].take(2, 0, 0)
    boxes[2].take(2, 0, 0)
    d = decide([want(1, priority=5, ranks=4)], boxes, running=[running[0], running[3]], preemption=True)
    assert d.preempt == [10]
    # a gang that no set of lower-priority jobs can make room for asks nobody
    boxes = [box("w1", slots=2, tasks=2), box("w2", slots=2, tasks=2), box("w3", slots=2, tasks=2)]
    for b in boxes:
        b.take(2, 0, 0)
    high = [Running(10, 9, "w1", 2, 0, 0), Running(11, 0, "w2", 2, 0, 0), Running(13, 9, "w3", 2, 0, 0)]
    d = decide([want(1, priority=5, ranks=4)], boxes, running=high, preemption=True)
    assert d.preempt == [] and d.preempt_for is None


# ---- ticks on a real database -------------------------------------------------------------------


class Sent:
    def __init__(self) -> None:
        self.calls: list[tuple[int, str, int, int]] = []

    def __call__(self, _settings: Settings, *, job_id: int, queue: str, node_rank: int, nnodes: int) -> None:
        self.calls.append((job_id, queue, node_rank, nnodes))


SPEC = {
    "model": {"kind": "gpt", "layers": 1, "d_model": 16, "heads": 1, "seq_len": 8, "vocab_size": 64},
    "train": {"steps": 1, "batch_size": 2},
}


def _job(url: str, *, priority: int = 0, owner_id: int | None = None, world_size: int = 1) -> int:
    with session_for(url) as s:
        return dbj.create_job(
            s, name="j", spec=SPEC, priority=priority, owner_id=owner_id, world_size=world_size
        ).id


def _sched(url: str, sent: Sent, **kw: Any) -> Scheduler:
    return Scheduler(Settings(database_url=url, **kw), send=sent)


def test_tick_reserves_sends_and_frees(db_url: str) -> None:
    beat(db_url, "w1@h", slots=2)
    beat(db_url, "w2@h", slots=2)
    low = [_job(db_url) for _ in range(3)]
    high = _job(db_url, priority=3)
    sent = Sent()
    sched = _sched(db_url, sent)
    sched.tick()
    placed = {c[0] for c in sent.calls}
    assert placed == {high, low[0]}
    assert {c[1] for c in sent.calls} == {"node.w1@h", "node.w2@h"}
    with session_for(db_url) as s:
        assert dbj.get_job(s, low[1]).wait_reason.startswith("workers busy: needs")
        assert s.query(Reservation).count() == 2
    sched.tick()  # nothing changed: nothing more is sent
    assert len(sent.calls) == 2
    # the high job runs on its worker and ends: its slots go to the next in line
    worker = next(c[1] for c in sent.calls if c[0] == high).removeprefix("node.")
    with session_for(db_url) as s:
        attempt = dbj.claim_job(s, job_id=high, owner="p", worker=worker, lease_s=30, reserved=True)
        assert attempt is not None
        assert (
            dbj.claim_job(s, job_id=low[0], owner="p", worker="elsewhere", lease_s=30, reserved=True) is None
        )
        dbj.finish_job(s, attempt=attempt, status=dbj.JobStatus.succeeded)
        assert s.query(Reservation).filter_by(job_id=high).count() == 0
    sched.tick()
    assert sent.calls[-1][0] == low[1]


def test_unclaimed_reservations_of_a_dead_worker_are_freed(db_url: str) -> None:
    beat(db_url, "w1@h", slots=2)
    job = _job(db_url)
    sent = Sent()
    sched = _sched(db_url, sent, worker_alive_s=5)
    sched.tick()
    assert sent.calls == [(job, "node.w1@h", 0, 1)]
    # w1 stopped beating 10 s ago (its beat moved back: a sleep past a short window failed under
    # load, when w2's own beat aged past it before the tick); w2 appears
    with session_for(db_url) as s:
        s.execute(
            update(WorkerBeat)
            .where(WorkerBeat.name == "w1@h")
            .values(last_seen=dbj.db_now(s) - timedelta(seconds=10))
        )
        s.commit()
    beat(db_url, "w2@h", slots=2)
    sched.tick()
    assert sent.calls[-1] == (job, "node.w2@h", 0, 1)


def test_wide_job_is_reserved_as_a_gang_in_one_transaction(db_url: str) -> None:
    beat(db_url, "w1@h", slots=2)
    beat(db_url, "w2@h", slots=2)
    job = _job(db_url, world_size=4)
    sent = Sent()
    _sched(db_url, sent).tick()
    assert sorted((c[2], c[3]) for c in sent.calls) == [(0, 2), (1, 2)]
    with session_for(db_url) as s:
        rows = s.query(Reservation).filter_by(job_id=job).order_by(Reservation.node_rank).all()
        assert [(r.node_rank, r.nnodes, r.slots) for r in rows] == [(0, 2, 2), (1, 2, 2)]
        assert {r.worker for r in rows} == {"w1@h", "w2@h"}
        assert dbj.get_job(s, job).nnodes == 2


def test_fair_share_across_ticks_on_the_database(db_url: str) -> None:
    beat(db_url, "w1@h", slots=1, tasks=1)
    with session_for(db_url) as s:
        ann, bob = create_user(s, name="ann").id, create_user(s, name="bob").id
    ids = [_job(db_url, owner_id=ann) for _ in range(3)] + [_job(db_url, owner_id=bob) for _ in range(3)]
    owner = dict(zip(ids, [ann] * 3 + [bob] * 3, strict=True))
    sent = Sent()
    sched = _sched(db_url, sent)
    order = []
    for _ in range(4):
        sched.tick()
        job_id = sent.calls[-1][0]
        order.append(owner[job_id])
        with session_for(db_url) as s:  # it runs and ends at once
            a = dbj.claim_job(s, job_id=job_id, owner="p", worker="w1@h", lease_s=30, reserved=True)
            dbj.finish_job(s, attempt=a, status=dbj.JobStatus.succeeded)
    assert order == [ann, bob, ann, bob]


def test_quota_reason_is_written_and_lifted(db_url: str) -> None:
    beat(db_url, "w1@h", slots=4, tasks=4)
    with session_for(db_url) as s:
        cy = create_user(s, name="cy", max_running_jobs=1).id
    first, second = _job(db_url, owner_id=cy), _job(db_url, owner_id=cy)
    sent = Sent()
    _sched(db_url, sent).tick()
    assert [c[0] for c in sent.calls] == [first]
    with session_for(db_url) as s:
        assert dbj.get_job(s, second).wait_reason == "quota: 1 of cy's jobs are running, the quota is 1"


def test_only_the_wait_reasons_that_changed_are_rewritten(db_url: str) -> None:
    """A reason is written when it changes, not on every tick (with 1,000 queued jobs a rewrite of
    each one every tick would be most of the tick's database time). Counted as the rows the
    reason UPDATEs changed in the database."""
    beat(db_url, "w1@h", slots=1, tasks=1)
    with session_for(db_url) as s:
        dee = create_user(s, name="dee", max_running_jobs=0).id
    first = _job(db_url, priority=3)
    blocked, middle, last = _job(db_url, priority=2), _job(db_url, priority=1), _job(db_url)
    capped = _job(db_url, owner_id=dee)
    rewritten: list[int] = []

    def count(_conn: Any, cursor: Any, statement: str, *_: Any) -> None:
        if statement.startswith("UPDATE jobs SET wait_reason"):
            rewritten.append(cursor.rowcount)

    engine = get_engine(db_url)
    event.listen(engine, "after_cursor_execute", count)
    try:
        sched = _sched(db_url, Sent())
        sched.tick()  # `first` runs; every other job gets its first reason
        assert sum(rewritten) == 4
        rewritten.clear()
        sched.tick()  # nothing changed: nothing written
        assert rewritten == []
        with session_for(db_url) as s:
            dbj.request_cancel(s, job_id=blocked)
        sched.tick()  # `middle` is the blocker now: its reason and `last`'s change, `capped`'s not
        assert sum(rewritten) == 2
    finally:
        event.remove(engine, "after_cursor_execute", count)
    with session_for(db_url) as s:
        reasons = {j: dbj.get_job(s, j).wait_reason for j in (first, middle, last, capped)}
    assert reasons == {
        first: None,
        middle: "workers busy: needs 1 free slot(s); most free now: 0 (the fleet can hold it once running jobs end)",
        last: f"behind higher-priority job {middle}",
        capped: "quota: 0 of dee's jobs are running, the quota is 0",
    }


def test_wait_reasons_are_set_and_cleared_on_queued_jobs_only(db_url: str) -> None:
    a, b, ran = _job(db_url), _job(db_url), _job(db_url)
    many = [_job(db_url) for _ in range(30)]
    with session_for(db_url) as s:
        dbs.set_wait_reasons(s, {a: "first", b: "first"})
        s.execute(update(Job).where(Job.id == ran).values(status=JobStatus.running))
        s.commit()
        dbs.set_wait_reasons(s, {a: None, b: "second", ran: "third"})
        assert [dbj.get_job(s, j).wait_reason for j in (a, b, ran)] == [None, "second", None]
        # a statement per distinct reason: many jobs, a few texts, each job its own
        dbs.set_wait_reasons(
            s, {j: f"behind higher-priority job {j % 3}" for j in many} | {a: "it's 'quoted'"}
        )
        assert [dbj.get_job(s, j).wait_reason for j in many] == [
            f"behind higher-priority job {j % 3}" for j in many
        ]
        assert dbj.get_job(s, a).wait_reason == "it's 'quoted'"


def test_the_lock_is_held_only_by_its_holder_within_its_lease(db_url: str) -> None:
    """lock_held: true for the holder while the lease runs past the time given; otherwise the
    transaction is rolled back and the caller writes nothing."""
    with session_for(db_url) as s:
        now = dbj.db_now(s)
        assert dbs.acquire_lock(s, holder="me", lease_s=10, now=now)
        assert dbs.lock_held(s, holder="me", until=now + timedelta(seconds=5))
        s.commit()
        assert not dbs.lock_held(s, holder="you", until=now)
        assert not dbs.lock_held(s, holder="me", until=now + timedelta(seconds=11))
        assert not s.in_transaction()


def test_one_scheduler_holds_the_lock(db_url: str) -> None:
    beat(db_url, "w1@h", slots=2)
    _job(db_url)
    a, b = Sent(), Sent()
    first, second = _sched(db_url, a), _sched(db_url, b)
    assert first.tick() is not None
    assert second.tick() is None and b.calls == []
    with session_for(db_url) as s:
        dbs.release_lock(s, holder=first.holder)
    assert second.tick() is not None


def test_racing_reservations_never_double_book(db_url: str) -> None:
    """Two schedulers (the lock bypassed: as if one's lease had lapsed mid-tick) reserve the one
    free slot of a worker for two different jobs at the same instant: exactly one wins."""
    beat(db_url, "w1@h", slots=1, tasks=1)
    jobs = [_job(db_url), _job(db_url)]
    cap = {"w1@h": dbs.Capacity(slots=1, tasks=1, gpus=0, ram_bytes=64 * GiB)}
    barrier = threading.Barrier(2)
    wins: list[int] = []

    def race(job_id: int) -> None:
        with session_for(db_url) as s:
            barrier.wait()
            if dbs.reserve(s, job_id=job_id, nodes=[dbs.Node("w1@h", 1, 0, GiB)], capacity=cap):
                wins.append(job_id)

    together(race, jobs)
    assert len(wins) == 1
    with session_for(db_url) as s:
        assert s.query(Reservation).count() == 1
        # and one job cannot be reserved twice
        other = next(j for j in jobs if j != wins[0])
        big = {"w1@h": dbs.Capacity(slots=8, tasks=8, gpus=0, ram_bytes=64 * GiB)}
        assert dbs.reserve(s, job_id=wins[0], nodes=[dbs.Node("w1@h", 1, 0, 0)], capacity=big) is None
        assert dbs.reserve(s, job_id=other, nodes=[dbs.Node("w1@h", 1, 0, 0)], capacity=big) is not None


def test_preemption_flag_is_set_on_the_lower_priority_job(db_url: str) -> None:
    beat(db_url, "w1@h", slots=1, tasks=1)
    low = _job(db_url)
    sent = Sent()
    sched = _sched(db_url, sent, preemption=True)
    sched.tick()
    with session_for(db_url) as s:
        assert dbj.claim_job(s, job_id=low, owner="p", worker="w1@h", lease_s=30, reserved=True)
    high = _job(db_url, priority=5)
    sched.tick()
    with session_for(db_url) as s:
        job = dbj.get_job(s, low)
        assert (job.preempt_requested, job.wait_reason) == (True, f"preempted by job {high}")
        assert "preempting job(s) " + str(low) in dbj.get_job(s, high).wait_reason


def test_a_send_that_fails_is_retried_next_tick_and_logged_once(db_url: str) -> None:
    beat(db_url, "w1@h", slots=2)
    job = _job(db_url)
    sent = Sent()
    down = {"on": True}

    def send(settings: Settings, **kw: Any) -> None:
        if down["on"]:
            raise ConnectionError("redis is down")
        sent(settings, **kw)

    sched = Scheduler(Settings(database_url=db_url), send=send)
    sched.tick()
    sched.tick()
    with session_for(db_url) as s:
        (row,) = s.query(Reservation).filter_by(job_id=job).all()
        assert row.sent_at is None
        logs = [e.message for e in dbi.events_after(s, job_id=job, kinds=["log"])]
        assert logs == ["broker unavailable, will retry: redis is down"]
    down["on"] = False
    sched.tick()
    assert sent.calls == [(job, "node.w1@h", 0, 1)]


def _counting(tmp_path: Any) -> tuple[Scheduler, list[float]]:
    """A started scheduler loop (timed ticks every 5 s) whose ticks only note when they ran."""
    ticks: list[float] = []

    class Counting(Scheduler):
        def tick(self) -> None:  # type: ignore[override]
            ticks.append(time.monotonic())

    return Counting(
        Settings(database_url=f"sqlite:///{tmp_path / 'none.db'}", scheduler_s=5.0)
    ).start(), ticks


def test_a_burst_of_wakes_is_placed_by_few_ticks(tmp_path: Any) -> None:
    """A submit wakes the loop at once, but a stream of submits gets one tick per WAKE_GAP_S, not
    one per submit (each tick orders the whole queue, in the API's process)."""
    sched, ticks = _counting(tmp_path)
    try:
        _until = time.monotonic() + 1.0
        while time.monotonic() < _until:  # 100 submits a second for a second
            sched.wake()
            time.sleep(0.01)
    finally:
        sched.stop()
    woken = ticks[1:]  # the first is the loop's timed tick at start
    # (a tick per submit would be about 100, 0.01 s apart; a late stop may let one more by)
    assert 2 <= len(woken) <= 1.0 / WAKE_GAP_S + 2, ticks
    assert min(b - a for a, b in zip(woken, woken[1:], strict=False)) >= WAKE_GAP_S / 2


def test_a_lone_wake_just_after_a_timed_tick_is_answered_at_once(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The gap holds back woken ticks only: a submit that lands just after the timed tick is placed
    now, not up to WAKE_GAP_S later (what a lone selection batch waited in bench.peer)."""
    monkeypatch.setattr(scheduler_loop, "WAKE_GAP_S", 2.0)  # held back, it would wait about 2 s
    sched, ticks = _counting(tmp_path)
    try:
        while not ticks:
            time.sleep(0.001)
        time.sleep(0.02)  # well inside WAKE_GAP_S of the timed tick
        woke = time.monotonic()
        sched.wake()
        while len(ticks) < 2 and time.monotonic() < woke + 5:
            time.sleep(0.001)
    finally:
        sched.stop()
    assert len(ticks) >= 2, ticks
    assert ticks[1] - woke < 1.0, ticks[1] - woke


def test_preemption_asks_a_running_job_not_one_only_reserved(db_url: str) -> None:
    """A lower-priority job that is reserved but not started cannot be asked to checkpoint
    (request_preemption asks running jobs): choosing it asked nobody and said it had."""
    beat(db_url, "w1@h", slots=1, tasks=1)
    beat(db_url, "w2@h", slots=1, tasks=1)
    waiting, started = _job(db_url), _job(db_url)
    sent = Sent()
    sched = _sched(db_url, sent, preemption=True)
    sched.tick()
    where = {job_id: queue.removeprefix("node.") for job_id, queue, _, _ in sent.calls}
    assert where == {waiting: "w1@h", started: "w2@h"}
    with session_for(db_url) as s:  # only the job on w2 has started
        assert dbj.claim_job(s, job_id=started, owner="p", worker="w2@h", lease_s=30, reserved=True)
    high = _job(db_url, priority=5)
    sched.tick()
    with session_for(db_url) as s:
        assert dbj.get_job(s, started).preempt_requested
        assert not dbj.get_job(s, waiting).preempt_requested
        assert f"preempting job(s) {started}" in dbj.get_job(s, high).wait_reason
