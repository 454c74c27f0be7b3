"""Retries of attempts that failed for the infrastructure (db/jobs.py restart_job, expire_leases
with max_restarts), against real SQLite and real PostgreSQL: each one goes back to the queue with
its reason in the job's events, counted in jobs.restarts; once max_restarts are used the next one
ends the job `failed` naming every attempt's reason."""

from __future__ import annotations

import time

from db import ingest as dbi
from db import jobs as dbj
from db.engine import session_for
from db.models import JobStatus
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
    assert job.error.startswith(
        "2 attempts failed for the infrastructure (max_restarts=1): attempt 1: the lease of w"
    )
    assert "attempt 2: the lease of w (attempt 2) ran out: the worker was lost" in job.error
    (ev,) = _restart_events(db_url, job_id)
    assert ev["restart"] == 1 and "ran out" in ev["reason"]

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
