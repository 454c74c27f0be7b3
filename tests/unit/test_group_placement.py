"""Selection groups placed by the scheduler (core/scheduler.py) on a real database (SQLite and
Postgres, migrated by Alembic): each group of a batch's queued trials reserves the batch's devices
on one worker, its task goes to that worker's queue, and the reservation is freed when the group
ends, its trials' leases run out, its worker dies before the claim, or the batch is cancelled.
The broker is replaced by a recorder of what would be sent; the integration tests
(tests/integration/test_selection_placement.py) run the real workers."""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from typing import Any

import pytest
from sqlalchemy import update

from core.scheduler import queue_positions
from core.scheduler_loop import Scheduler
from core.settings import Settings
from db import jobs as dbj
from db import scheduling as dbs
from db import selections as dbsel
from db.connection import session_for
from db.models import Job, JobStatus, Reservation, Trial
from db.users import create_user
from tests.conftest import beat

GiB = 2**30
SPEC = {
    "model": {"kind": "gpt", "layers": 1, "d_model": 16, "heads": 1, "seq_len": 8, "vocab_size": 64},
    "train": {"steps": 1, "batch_size": 2},
}


class Sent:
    """Records the tasks a tick would send: jobs and selection groups."""

    def __init__(self) -> None:
        self.jobs: list[tuple[int, str]] = []
        self.groups: list[tuple[int, list[int], str, int]] = []

    def job(self, _settings: Settings, *, job_id: int, queue: str, node_rank: int, nnodes: int) -> None:
        self.jobs.append((job_id, queue))

    def group(
        self, _settings: Settings, *, selection_id: int, trial_ids: list[int], queue: str, reservation_id: int
    ) -> None:
        self.groups.append((selection_id, trial_ids, queue, reservation_id))


def _batch(
    url: str,
    trials: int,
    *,
    group_size: int = 1,
    devices: int = 1,
    owner_id: int | None = None,
    priority: int = 0,
) -> tuple[int, list[int]]:
    """A selection with `trials` queued trials; returns (selection id, trial ids in index order)."""
    with session_for(url) as s:
        sel = dbsel.create_selection(
            s,
            name="b",
            request={"group_size": group_size, "devices": devices, "method": "grid"},
            metric="val_loss",
            mode="min",
            scheduler="shard-lrtf",
            owner_id=owner_id,
        )
        spec = {**SPEC, "priority": priority}
        plans = [(i, {"train.lr": 0.001 * (i + 1)}, spec) for i in range(trials)]
        made = dbsel.add_trials(s, selection_id=sel.id, plans=plans, queue="cpu", owner_id=owner_id)
        return sel.id, [t.id for t in made]


def _sched(url: str, sent: Sent, **kw: Any) -> Scheduler:
    return Scheduler(Settings(database_url=url, **kw), send=sent.job, send_group=sent.group)


def _held(url: str) -> list[tuple[str, list[int] | None, bool]]:
    with session_for(url) as s:
        return sorted((r.worker, r.trial_ids, r.claimed_at is not None) for r in s.query(Reservation).all())


def _trial_job(url: str, trial_id: int) -> Job:
    with session_for(url) as s:
        t = s.get(Trial, trial_id)
        job = s.get(Job, t.job_id)
        s.expunge(job)
        return job


def test_groups_of_a_batch_spread_over_two_workers_and_the_third_waits(db_url: str) -> None:
    beat(db_url, "w1@h")
    beat(db_url, "w2@h")
    sel, trials = _batch(db_url, 3)
    sent = Sent()
    sched = _sched(db_url, sent)
    sched.tick()
    # one group on each 1-slot worker, each task to its worker's own queue with its reservation
    assert sorted(g[1] for g in sent.groups) == [[trials[0]], [trials[1]]]
    assert sorted(g[2] for g in sent.groups) == ["node.w1@h", "node.w2@h"]
    assert {g[0] for g in sent.groups} == {sel} and sent.jobs == []
    held = _held(db_url)
    assert sorted(h[0] for h in held) == ["w1@h", "w2@h"]
    assert sorted(h[1][0] for h in held) == trials[:2]
    # the third group waits with the reason, and is in the queue view
    third = _trial_job(db_url, trials[2])
    assert (
        third.wait_reason
        == "workers busy: needs 1 free slot(s); most free now: 0 (the fleet can hold it once running jobs end)"
    )
    with session_for(db_url) as s:
        order = queue_positions(s, Settings(database_url=db_url))
    assert [(w.id, w.trials, w.selection) for w in order] == [(third.id, (trials[2],), sel)]
    sched.tick()
    assert len(sent.groups) == 2  # nothing changed: nothing more sent

    # the group on w1 is claimed by its worker (its reservation with it), runs, and ends
    g1 = next(g for g in sent.groups if g[2] == "node.w1@h")
    with session_for(db_url) as s:
        assert (
            dbsel.claim_trials(
                s, trial_ids=g1[1], owner="p2", worker="w2@h", lease_s=30, reservation_id=g1[3]
            )
            == []
        )
        won = dbsel.claim_trials(
            s, trial_ids=g1[1], owner="p1", worker="w1@h", lease_s=30, reservation_id=g1[3]
        )
        assert [t.id for t, _ in won] == g1[1]
        # a second process (a duplicate message) gets nothing
        assert (
            dbsel.claim_trials(
                s, trial_ids=g1[1], owner="p3", worker="w1@h", lease_s=30, reservation_id=g1[3]
            )
            == []
        )
    sched.tick()
    assert len(sent.groups) == 2  # still running: w1 is busy
    with session_for(db_url) as s:
        trial, attempt = won[0]
        trial = s.merge(trial)
        assert dbsel.finish_trial(s, trial=trial, status="succeeded", attempt=attempt)
        dbsel.free_group(s, reservation_id=g1[3], worker="w1@h", owner="p1")
        s.commit()
    sched.tick()
    assert sent.groups[-1][1:3] == ([trials[2]], "node.w1@h")
    assert _trial_job(db_url, trials[2]).wait_reason is None


def test_a_group_whose_trials_lease_ran_out_is_freed_and_placed_again(db_url: str) -> None:
    beat(db_url, "w1@h", slots=2, tasks=2)
    _sel, trials = _batch(db_url, 2, group_size=2)
    sent = Sent()
    sched = _sched(db_url, sent)
    sched.tick()
    ((_, ids, queue, rid),) = sent.groups
    assert (ids, queue) == (trials, "node.w1@h")
    with session_for(db_url) as s:
        won = dbsel.claim_trials(
            s, trial_ids=ids, owner="dead", worker="w1@h", lease_s=30, reservation_id=rid
        )
        assert len(won) == 2
        # the first trial ends; the second still runs under the group's task: the slots stay held
        trial, attempt = won[0]
        assert dbsel.finish_trial(s, trial=s.merge(trial), status="succeeded", attempt=attempt)
    sched.tick()
    assert len(sent.groups) == 1 and len(_held(db_url)) == 1
    # the worker dies: the second trial's lease runs out and the reconciler takes it back
    with session_for(db_url) as s:
        s.execute(update(Job).where(Job.id == won[1][0].job_id).values(lease_until=dbj.utcnow()))
        s.commit()
        time.sleep(0.05)
        requeued, _ = dbj.expire_leases(s)
        assert [j.id for j in requeued] == [won[1][0].job_id]
        dbsel.sync_trials(s, job_ids=[won[1][0].job_id])
    sched.tick()
    # the old reservation is gone (no trial runs under it) and the trial is placed again alone
    assert len(sent.groups) == 2 and sent.groups[-1][1] == [trials[1]]
    assert _held(db_url) == [("w1@h", [trials[1]], False)]


def test_unclaimed_group_moves_off_a_dead_worker_and_a_lost_message_is_sent_again(db_url: str) -> None:
    beat(db_url, "w1@h")
    _sel, trials = _batch(db_url, 1)
    sent = Sent()
    sched = _sched(db_url, sent, worker_alive_s=0.5, requeue_after_s=0.3)
    # beat again right before the tick: on a loaded machine the batch's set-up alone can take
    # longer than the 0.5 s alive window, and the worker would count as dead already
    beat(db_url, "w1@h")
    sched.tick()
    assert sent.groups[-1][1:3] == (trials, "node.w1@h")
    time.sleep(0.4)  # never claimed: the message was lost, it goes again to the same worker
    beat(db_url, "w1@h")
    sched.tick()
    assert len(sent.groups) == 2 and sent.groups[-1][2:] == sent.groups[0][2:]
    time.sleep(0.7)  # w1 stops beating; w2 appears
    beat(db_url, "w2@h")
    sched.tick()
    assert sent.groups[-1][1:3] == (trials, "node.w2@h")
    assert [h[0] for h in _held(db_url)] == ["w2@h"]


def test_cancelling_the_batch_frees_its_unclaimed_groups(db_url: str) -> None:
    beat(db_url, "w1@h")
    sel, _trials = _batch(db_url, 1)
    sent = Sent()
    sched = _sched(db_url, sent)
    sched.tick()
    assert len(_held(db_url)) == 1
    with session_for(db_url) as s:
        dbsel.cancel_selection(s, selection_id=sel)
    sched.tick()
    assert _held(db_url) == []


def test_a_group_that_ran_counts_in_its_owners_recent_slot_minutes(db_url: str) -> None:
    """Fair share's usage over the window counts a selection group as it counts a job: the
    batch's devices (slots) from the group's claim, which its trials share as started_at, to
    the end of its last trial. Before, only jobs counted: a user whose batches had just used
    the fleet for an hour stood as if idle."""
    beat(db_url, "w1@h", slots=2)
    with session_for(db_url) as s:
        ann = create_user(s, name="ann").id
    _, trials = _batch(db_url, 2, group_size=2, devices=2, owner_id=ann)
    sent = Sent()
    _sched(db_url, sent).tick()
    ((_, ids, _, rid),) = sent.groups
    assert ids == trials
    with session_for(db_url) as s:
        won = dbsel.claim_trials(s, trial_ids=ids, owner="p", worker="w1@h", lease_s=30, reservation_id=rid)
        jobs = [s.get(Job, t.job_id) for t, _ in won]
        assert len({j.started_at for j in jobs}) == 1  # one start: the group's claim
        now = dbj.db_now(s)
        # as if the group ran from 30 minutes ago and its trials ended 20 and 10 minutes ago
        s.execute(
            update(Job).where(Job.id.in_([j.id for j in jobs])).values(started_at=now - timedelta(minutes=30))
        )
        for job, ago in zip(jobs, (20, 10), strict=True):
            s.execute(
                update(Job)
                .where(Job.id == job.id)
                .values(status=JobStatus.succeeded, finished_at=now - timedelta(minutes=ago), owner=None)
            )
        s.commit()
        used = dbs.recent_usage(s, window_s=3600, now=now)
        assert used[ann][0] == 2 * 20  # 2 slots for 20 minutes, not 2 x 2 trials
        assert dbs.recent_usage(s, window_s=15 * 60, now=now)[ann][0] == 2 * 5  # the window's part
        # while a trial still runs, the group counts up to now
        s.execute(update(Job).where(Job.id == jobs[1].id).values(status=JobStatus.running, finished_at=None))
        s.commit()
        assert dbs.recent_usage(s, window_s=3600, now=now)[ann][0] == 2 * 30


def _batch_of_a_one_job_owner(db_url: str, name: str, n: int, *, slots: int) -> tuple[int, int, list[int]]:
    """A worker with `slots` slots and tasks; user `name`, who may run one job at a time; a batch of
    hers with `n` trials: (her id, the batch, its trials)."""
    beat(db_url, "w1@h", slots=slots, tasks=slots)
    with session_for(db_url) as s:
        uid = create_user(s, name=name, max_running_jobs=1).id
    sel, trials = _batch(db_url, n, owner_id=uid)
    return uid, sel, trials


def test_groups_obey_the_owners_quota_and_priority_order(db_url: str) -> None:
    uid, _sel, trials = _batch_of_a_one_job_owner(db_url, "ann", 2, slots=4)
    sent = Sent()
    sched = _sched(db_url, sent)
    sched.tick()
    # ann may run one thing at a time: one group placed, the other waits with the quota reason
    assert len(sent.groups) == 1
    waiting = next(t for t in trials if [t] != sent.groups[0][1])
    assert _trial_job(db_url, waiting).wait_reason == "quota: 1 of ann's jobs are running, the quota is 1"
    # a plain job of hers waits behind the same quota (the group counts as one running job)
    with session_for(db_url) as s:
        job = dbj.create_job(s, name="j", spec=SPEC, owner_id=uid).id
    sched.tick()
    assert sent.jobs == []
    with session_for(db_url) as s:
        assert dbj.get_job(s, job).wait_reason.startswith("quota: 1 of ann's jobs are running")


def test_a_batch_of_higher_priority_goes_before_older_jobs(db_url: str) -> None:
    beat(db_url, "w1@h")
    with session_for(db_url) as s:
        job = dbj.create_job(s, name="j", spec=SPEC).id
    _sel, trials = _batch(db_url, 1, priority=5)
    with session_for(db_url) as s:
        order = queue_positions(s, Settings(database_url=db_url))
    assert [w.trials for w in order] == [(trials[0],), ()]
    sent = Sent()
    _sched(db_url, sent).tick()
    assert [g[1] for g in sent.groups] == [trials] and sent.jobs == []
    with session_for(db_url) as s:
        assert (
            dbj.get_job(s, job).wait_reason
            == "workers busy: needs 1 free slot(s); most free now: 0 (the fleet can hold it once running jobs end)"
        )


# ---- the worker's side of a placed group (workers/selection.py, before any trainer starts) ------


def test_the_worker_runs_only_a_group_reserved_for_it_and_gives_back_one_over_quota(db_url: str) -> None:
    from workers.selection import execute_selection

    uid, sel, trials = _batch_of_a_one_job_owner(db_url, "bo", 1, slots=2)
    sent = Sent()
    _sched(db_url, sent).tick()
    ((_, ids, _queue, rid),) = sent.groups
    settings = Settings(database_url=db_url, lease_s=5)
    # a message without a reservation (sent before groups were placed) or for another worker
    assert execute_selection(sel, ids, settings=settings, worker="w1@h") == "skipped"
    assert execute_selection(sel, ids, settings=settings, worker="w2@h", reservation_id=rid) == "skipped"
    assert _held(db_url) == [("w1@h", trials, False)]
    # meanwhile bo's quota filled up: the claim refuses, gives the slots back, the trial waits
    with session_for(db_url) as s:
        job = dbj.create_job(s, name="j", spec=SPEC, owner_id=uid).id
        s.execute(update(Job).where(Job.id == job).values(status=dbj.JobStatus.running))
        s.commit()
    assert execute_selection(sel, ids, settings=settings, worker="w1@h", reservation_id=rid) == "waiting"
    assert _held(db_url) == []
    waiting = _trial_job(db_url, trials[0])
    assert waiting.status == "queued" and waiting.wait_reason == "1 of bo's jobs are running, the quota is 1"


def test_overlapping_groups_reserved_at_once_on_two_workers_never_share_a_trial(
    db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two schedulers (one with a lapsed lease, still mid-tick) reserve overlapping groups of one
    batch on two different workers. The first is held inside its transaction after it read its
    trials as free and before it wrote anything for them; the second must wait for it and then
    find a trial taken. Before the selection row was locked, on Postgres the second booked trials
    2 and 3 meanwhile and the first then booked 1 and 2 on what it had read (each worker's row
    lock orders only its own reservations); SQLite has one writer at a time."""
    beat(db_url, "w1@h", slots=4, tasks=4)
    beat(db_url, "w2@h", slots=4, tasks=4)
    _, trials = _batch(db_url, 3)
    cap = {w: dbs.Capacity(slots=4, tasks=4, gpus=0, ram_bytes=64 * GiB) for w in ("w1@h", "w2@h")}
    first_checked, go_on = threading.Event(), threading.Event()
    real = dbs.update

    def held_after_the_reads(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        # _group_free's first write (the trials' wait reasons) comes right after its reads
        if threading.current_thread().name == "first" and not first_checked.is_set():
            first_checked.set()
            go_on.wait(timeout=30)
        return real(*args, **kwargs)

    monkeypatch.setattr(dbs, "update", held_after_the_reads)
    got: dict[str, Any] = {}

    def book(name: str, worker: str, group: list[int]) -> None:
        job_id = _trial_job(db_url, group[0]).id
        with session_for(db_url) as s:
            got[name] = dbs.reserve(
                s, job_id=job_id, nodes=[dbs.Node(worker, 1, 0, GiB)], capacity=cap, trial_ids=group
            )

    try:
        a = threading.Thread(target=book, args=("first", "w1@h", trials[:2]), name="first")
        a.start()
        assert first_checked.wait(timeout=30)
        b = threading.Thread(target=book, args=("second", "w2@h", trials[1:]), name="second")
        b.start()
        b.join(timeout=1.0)  # the second either waits for the first (locked) or books at once
        go_on.set()
        a.join(timeout=30)
        b.join(timeout=30)
    finally:
        go_on.set()
    assert got["first"] is not None
    assert got["second"] is None, "the second group was booked with a trial the first holds"
    held = [t for _, ids, _ in _held(db_url) for t in ids or []]
    assert sorted(held) == sorted(set(held)) == sorted(trials[:2])
