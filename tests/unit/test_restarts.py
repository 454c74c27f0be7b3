"""Retries of attempts that failed for the infrastructure (db/jobs.py restart_job, expire_leases
with max_restarts), against real SQLite and real PostgreSQL: each one goes back to the queue with
its reason in the job's events, counted in jobs.restarts; once max_restarts are used the next one
ends the job `failed` naming every attempt's reason."""

from __future__ import annotations

import re
import time
from datetime import timedelta

import pytest
from sqlalchemy import update

from db import ingest as dbi
from db import jobs as dbj
from db import workers as dbw
from db.connection import session_for
from db.models import Job, JobStatus, WorkerBeat, utcnow
from jobrules.restarts import DEFAULT_MAX_RESTARTS, max_restarts


def _job(url: str, **spec: object) -> int:
    with session_for(url) as s:
        return dbj.create_job(s, name="j", spec={"train": {"steps": 9}, **spec}, steps=9).id


def _claim(url: str, job_id: int, *, lease_s: float = 30) -> dbj.Attempt:
    with session_for(url) as s:
        got = dbj.claim_job(s, job_id=job_id, owner=f"o{time.monotonic_ns()}", worker="w", lease_s=lease_s)
    assert got is not None
    return got


def _restart_events(url: str, job_id: int) -> list[dict]:
    with session_for(url) as s:
        evs = dbi.events_after(s, job_id=job_id, after_id=0, limit=100)
    return [
        e.data for e in evs if e.kind == "status" and e.message == "queued" and (e.data or {}).get("restart")
    ]


def test_a_killed_rank_is_retried_up_to_max_restarts_then_fails_with_every_reason(db_url: str) -> None:
    job_id = _job(db_url, max_restarts=2)
    for n in (1, 2):
        attempt = _claim(db_url, job_id)
        with session_for(db_url) as s:
            why = f"rank 1 (pid {100 + n}) was killed by SIGKILL (exit code -9)"
            assert dbj.restart_job(s, attempt=attempt, reason=why, max_restarts=2) == "queued"
            job = dbj.get_job(s, job_id)
            assert (job.status, job.restarts, job.owner) == (JobStatus.queued, n, None)
    assert [(d["restart"], d["attempt"], d["reason"]) for d in _restart_events(db_url, job_id)] == [
        (1, 1, "rank 1 (pid 101) was killed by SIGKILL (exit code -9)"),
        (2, 2, "rank 1 (pid 102) was killed by SIGKILL (exit code -9)"),
    ]
    last = _claim(db_url, job_id)
    with session_for(db_url) as s:
        assert dbj.restart_job(
            s, attempt=last, reason="rank 0 (pid 7) was killed by SIGTERM", max_restarts=2
        ) == ("failed")
        job = dbj.get_job(s, job_id)
    assert job.status == JobStatus.failed and job.restarts == 2
    assert job.error == (
        "3 attempts failed for the infrastructure (max_restarts=2): "
        "attempt 1: rank 1 (pid 101) was killed by SIGKILL (exit code -9); "
        "attempt 2: rank 1 (pid 102) was killed by SIGKILL (exit code -9); "
        "attempt 3: rank 0 (pid 7) was killed by SIGTERM"
    )


def test_max_restarts_zero_fails_at_once_and_a_stale_attempt_changes_nothing(db_url: str) -> None:
    job_id = _job(db_url, max_restarts=0)
    attempt = _claim(db_url, job_id, lease_s=0.2)
    time.sleep(0.4)
    newer = _claim(db_url, job_id)  # the lease ran out and another worker took the job
    with session_for(db_url) as s:
        assert dbj.restart_job(s, attempt=attempt, reason="old", max_restarts=0) is None
        assert dbj.restart_job(s, attempt=newer, reason="rank 1 died", max_restarts=0) == "failed"
        job = dbj.get_job(s, job_id)
    assert job.error == "rank 1 died (not retried: max_restarts is 0)" and job.restarts == 0


def test_a_lost_worker_counts_against_max_restarts(db_url: str) -> None:
    """The reconciler takes back a job whose lease ran out (its worker was lost): re-queued while
    restarts are left, failed with the reasons after; a trial is re-queued uncounted."""
    job_id = _job(db_url, max_restarts=1)
    for expect in ("queued", "failed"):
        _claim(db_url, job_id, lease_s=0.1)
        time.sleep(0.3)
        with session_for(db_url) as s:
            requeued, _ = dbj.expire_leases(s, max_restarts=max_restarts)
            job = dbj.get_job(s, job_id)
        assert job.status == expect
        assert [j.id for j in requeued] == ([job_id] if expect == "queued" else [])
    assert job.restarts == 1
    assert job.error == (
        "2 attempts failed for the infrastructure (max_restarts=1): "
        "attempt 1: w: the worker was lost (no heartbeat on record); "
        "attempt 2: w: the worker was lost (no heartbeat on record)"
    )
    (ev,) = _restart_events(db_url, job_id)
    assert ev["restart"] == 1 and ev["reason"] == "w: the worker was lost (no heartbeat on record)"

    # a spec stored before the field existed gets the default
    assert max_restarts({"train": {}}) == DEFAULT_MAX_RESTARTS


def test_without_a_limit_the_reconciler_requeues_uncounted(db_url: str) -> None:
    job_id = _job(db_url, max_restarts=0)
    _claim(db_url, job_id, lease_s=0.1)
    time.sleep(0.3)
    with session_for(db_url) as s:
        dbj.expire_leases(s)
        job = dbj.get_job(s, job_id)
    assert (job.status, job.restarts) == (JobStatus.queued, 0)


def _lapse(url: str, job_id: int) -> None:
    """The job's lease ran out a second ago, by database time (no sleep, no slow-machine race)."""
    with session_for(url) as s:
        s.execute(
            update(Job).where(Job.id == job_id).values(lease_until=dbj.db_now(s) - timedelta(seconds=1))
        )
        s.commit()


KILLED = "the worker process running it was killed (signal 9)"


@pytest.mark.parametrize("first", ["claim", "reconciler"])
def test_a_recorded_cause_is_the_reason_and_the_lost_attempt_counts_once(db_url: str, first: str) -> None:
    """The worker's main process saw the pool process holding the lease die and recorded why. A
    redelivered message's claim and the reconciler race for the lapsed lease: whichever wins, the
    restart is explained with that cause and counted once."""
    job_id = _job(db_url, max_restarts=3)
    with session_for(db_url) as s:
        dbj.claim_job(s, job_id=job_id, owner="host:4242:abc", worker="w", lease_s=60)
        dbj.claim_job(s, job_id=_job(db_url), owner="host:42420:x", worker="w", lease_s=60)  # not it
        assert dbj.record_lost(s, worker="w", owner_prefix="host:4242:", cause=KILLED) == [job_id]
    _lapse(db_url, job_id)
    with session_for(db_url) as s:
        if first == "reconciler":
            requeued, _ = dbj.expire_leases(s, max_restarts=max_restarts)
            assert [j.id for j in requeued] == [job_id]
        again = dbj.claim_job(
            s, job_id=job_id, owner="host:77:new", worker="w", lease_s=60, max_restarts=max_restarts
        )
        assert again is not None and again.attempt == 2
        assert dbj.expire_leases(s, max_restarts=max_restarts) == ([], [])  # the new lease is live
    with session_for(db_url) as s:
        job = dbj.get_job(s, job_id)
    assert (job.status, job.restarts, job.owner) == (JobStatus.running, 1, "host:77:new")
    (ev,) = _restart_events(db_url, job_id)
    assert (ev["restart"], ev["attempt"], ev["reason"]) == (1, 1, f"w: {KILLED}")


def test_without_a_record_the_heartbeat_says_whether_the_worker_or_its_process_was_lost(db_url: str) -> None:
    alive, gone = _job(db_url), _job(db_url)
    with session_for(db_url) as s:
        dbj.claim_job(s, job_id=alive, owner="a", worker="w1", lease_s=60)
        dbj.claim_job(s, job_id=gone, owner="b", worker="w2", lease_s=60)
        dbw.record_heartbeat(s, name="w2", hostname="h", queues=["cpu"], devices=[], host={})
    _lapse(db_url, alive)
    _lapse(db_url, gone)
    with session_for(db_url) as s:
        # w1 beats after its process's lease ran out; w2 was last heard of before
        s.execute(
            update(WorkerBeat)
            .where(WorkerBeat.name == "w2")
            .values(last_seen=utcnow() - timedelta(seconds=30))
        )
        s.commit()
        dbw.record_heartbeat(s, name="w1", hostname="h", queues=["cpu"], devices=[], host={})
        dbj.expire_leases(s, max_restarts=max_restarts)
    (a,) = _restart_events(db_url, alive)
    assert re.fullmatch(
        r"w1: the process running it was lost \(its lease ran out \d+ s ago while the worker, "
        r"or a restart of it, kept sending heartbeats\)",
        a["reason"],
    ), a["reason"]
    (b,) = _restart_events(db_url, gone)
    assert re.fullmatch(r"w2: the worker was lost \(no heartbeat for 3\d s\)", b["reason"]), b["reason"]
