"""Leases, fencing and exactly-once metric steps, against real SQLite and real PostgreSQL
(the db_url fixture migrates each by the real Alembic scripts)."""

from __future__ import annotations

import time
from datetime import timedelta

import pytest
from sqlalchemy import update

from db import ingest as dbi
from db import jobs as dbj
from db import selections as dbs
from db.connection import session_for
from db.models import Job, JobStatus, MetricPoint, Trial


def _job(url: str) -> int:
    with session_for(url) as s:
        return dbj.create_job(s, name="j", spec={"train": {"steps": 9}}, steps=9).id


def _apply(url: str, attempt: dbj.Attempt, lines: dbi.JobLines, lease_s: float = 30) -> dbi.Applied | None:
    with session_for(url) as s:
        got = dbi.apply_lines(s, attempt=attempt, lines=lines, lease_s=lease_s, now=dbj.db_now(s))
        s.commit()
        return got


def _series(url: str, job_id: int) -> list[tuple[int, float]]:
    with session_for(url) as s:
        rows = s.query(MetricPoint).filter_by(job_id=job_id, name="loss").order_by(MetricPoint.step).all()
        return [(p.step, p.value) for p in rows]


def test_a_live_lease_is_never_taken_an_expired_one_is(db_url: str) -> None:
    job_id = _job(db_url)
    with session_for(db_url) as s:
        first = dbj.claim_job(s, job_id=job_id, owner="a", worker="w@x", lease_s=30)
        assert first is not None and first.attempt == 1
        # another process start, same worker name: the name is not the lease
        assert dbj.claim_job(s, job_id=job_id, owner="b", worker="w@x", lease_s=30) is None
        assert dbj.lease_left_s(s, job_id=job_id) > 20
    with session_for(db_url) as s:
        short = _job(db_url)
        assert dbj.claim_job(s, job_id=short, owner="a", worker="w", lease_s=0.2) is not None
        time.sleep(0.4)
        assert dbj.lease_left_s(s, job_id=short) < 0
        taken = dbj.claim_job(s, job_id=short, owner="b", worker="w", lease_s=30)
        assert taken is not None and (taken.attempt, taken.owner) == (2, "b")


def test_a_retry_of_the_owners_own_task_reclaims(db_url: str) -> None:
    job_id = _job(db_url)
    with session_for(db_url) as s:
        assert dbj.claim_job(s, job_id=job_id, owner="a", worker="w", lease_s=30).attempt == 1
        again = dbj.claim_job(s, job_id=job_id, owner="a", worker="w", lease_s=30)
        assert again is not None and again.attempt == 2


def test_a_stale_attempt_writes_nothing(db_url: str) -> None:
    job_id = _job(db_url)
    with session_for(db_url) as s:
        old = dbj.claim_job(s, job_id=job_id, owner="a", worker="w", lease_s=0.1)
    time.sleep(0.3)
    with session_for(db_url) as s:
        new = dbj.claim_job(s, job_id=job_id, owner="b", worker="w", lease_s=30)
    assert _apply(db_url, old, dbi.JobLines(metrics=[(0, 1, "loss", 9.0, 1.0)], result=(1, {"x": 1}))) is None
    assert _series(db_url, job_id) == []
    with session_for(db_url) as s:
        assert dbj.finish_job(s, attempt=old, status=JobStatus.failed, error="zombie") is None
        assert not dbj.release_job(s, attempt=old, reason="zombie")
        assert not dbj.renew_lease(s, attempt=old, lease_s=30)
        job = dbj.get_job(s, job_id)
        assert (job.status, job.owner, job.result) == ("running", "b", None)
    assert _apply(db_url, new, dbi.JobLines(metrics=[(0, 1, "loss", 2.0, 1.0)])) is not None
    with session_for(db_url) as s:
        assert dbj.finish_job(s, attempt=new, status=JobStatus.succeeded) is not None
        assert dbj.get_job(s, job_id).status == "succeeded"


def test_metric_steps_are_stored_once_the_newest_attempt_winning(db_url: str) -> None:
    job_id = _job(db_url)
    with session_for(db_url) as s:
        a1 = dbj.claim_job(s, job_id=job_id, owner="a", worker="w", lease_s=0.1)
    got = _apply(db_url, a1, dbi.JobLines(metrics=[(i, i + 1, "loss", 10.0 - i, 1.0) for i in range(5)]), 0.1)
    assert [p["step"] for p in got.metrics] == [1, 2, 3, 4, 5]
    # the same batch again (a retry after a commit that did go through): nothing changes
    again = _apply(db_url, a1, dbi.JobLines(metrics=[(4, 5, "loss", -1.0, 1.0)]), 0.1)
    assert again is not None and again.metrics == []
    time.sleep(0.3)
    with session_for(db_url) as s:
        a2 = dbj.claim_job(s, job_id=job_id, owner="b", worker="w", lease_s=30)
    # a re-run from the checkpoint at step 3: steps 4..6, numbered from 0 again by the new process
    _apply(db_url, a2, dbi.JobLines(metrics=[(i, 4 + i, "loss", 1.0 + i, 2.0) for i in range(3)]))
    assert _series(db_url, job_id) == [(1, 10.0), (2, 9.0), (3, 8.0), (4, 1.0), (5, 2.0), (6, 3.0)]
    with session_for(db_url) as s:
        job = dbj.get_job(s, job_id)
        assert (job.step, job.last_loss) == (6, 3.0)


def test_a_result_is_stored_when_it_arrives_and_marks_the_applied_step(db_url: str) -> None:
    job_id = _job(db_url)
    with session_for(db_url) as s:
        a = dbj.claim_job(s, job_id=job_id, owner="a", worker="w", lease_s=30)
    _apply(db_url, a, dbi.JobLines(events=[(0, "event", "checkpoint", {"step": 4}, 1.0)]))
    with session_for(db_url) as s:
        assert dbj.get_job(s, job_id).applied_step == 4
    _apply(db_url, a, dbi.JobLines(result=(1, {"steps": 9, "final_loss": 1.5})))
    with session_for(db_url) as s:
        job = dbj.get_job(s, job_id)
        assert (job.status, job.result, job.applied_step) == ("running", {"steps": 9, "final_loss": 1.5}, 9)


def test_expired_leases_go_back_to_queued_or_end_cancelled(db_url: str) -> None:
    a, b, c = _job(db_url), _job(db_url), _job(db_url)
    with session_for(db_url) as s:
        dbj.claim_job(s, job_id=a, owner="x", worker="w", lease_s=60)
        dbj.claim_job(s, job_id=b, owner="x", worker="w", lease_s=60)
        dbj.claim_job(s, job_id=c, owner="y", worker="w", lease_s=60)
        dbj.request_cancel(s, job_id=b)  # a live lease: b is only asked to stop
        # then x's leases run out (set in the past by database time, so a slow machine cannot
        # let them lapse before the cancel above)
        s.execute(
            update(Job).where(Job.id.in_([a, b])).values(lease_until=dbj.db_now(s) - timedelta(seconds=1))
        )
        s.commit()
    with session_for(db_url) as s:
        requeued, cancelled = dbj.expire_leases(s)
        assert ([j.id for j in requeued], [j.id for j in cancelled]) == ([a], [b])
        assert [j.id for j in dbj.stale_queued_jobs(s, older_than_s=600)] == [a]
        assert dbj.get_job(s, c).status == "running"


def test_cancel_of_a_job_whose_owner_is_gone_is_immediate(db_url: str) -> None:
    job_id = _job(db_url)
    with session_for(db_url) as s:
        dbj.claim_job(s, job_id=job_id, owner="x", worker="w", lease_s=0.1)
    time.sleep(0.3)
    with session_for(db_url) as s:
        assert dbj.request_cancel(s, job_id=job_id).status == "cancelled"


def test_operator_fail_and_requeue_fence_the_running_attempt(db_url: str) -> None:
    job_id = _job(db_url)
    with session_for(db_url) as s:
        a = dbj.claim_job(s, job_id=job_id, owner="x", worker="w", lease_s=60)
        assert dbj.requeue_job(s, job_id=job_id, reason="operator").status == "queued"
        assert not dbj.renew_lease(s, attempt=a, lease_s=60)
        b = dbj.claim_job(s, job_id=job_id, owner="y", worker="w", lease_s=60)
        assert dbj.fail_job(s, job_id=job_id, reason="operator: bad data").status == "failed"
        assert dbj.finish_job(s, attempt=b, status=JobStatus.succeeded) is None
        with pytest.raises(dbj.Conflict):
            dbj.fail_job(s, job_id=job_id, reason="again")
        assert dbj.requeue_job(s, job_id=job_id, reason="try again").error is None


def test_a_trial_ends_only_with_its_result_and_the_batch_status_follows(db_url: str) -> None:
    with session_for(db_url) as s:
        sel = dbs.create_selection(s, name="b", request={}, metric="val_loss", mode="min", scheduler="x")
        spec = {"train": {"steps": 4}}
        trials = dbs.add_trials(s, selection_id=sel.id, plans=[(0, {}, spec), (1, {}, spec)], queue="cpu")
        ids = [t.id for t in trials]
        won = dbs.claim_trials(s, trial_ids=ids, owner="o", worker="w", lease_s=30)
        assert [t.index for t, _ in won] == [0, 1]
    (t0, a0), (t1, a1) = won

    def apply(trial: Trial, attempt: dbj.Attempt, lines: dbi.JobLines, progress: dbs.TrialProgress) -> None:
        with session_for(db_url) as s:
            got = dbs.apply_trial_lines(
                s,
                trial_id=trial.id,
                attempt=attempt,
                lines=lines,
                progress=progress,
                mode="min",
                lease_s=30,
                now=dbj.db_now(s),
            )
            assert got is not None
            s.commit()

    # trial 0: its result first, then (next batch) its end
    apply(
        t0, a0, dbi.JobLines(result=(3, {"steps": 4, "compute_s": 1.5})), dbs.TrialProgress(values=[2.0, 1.0])
    )
    apply(t0, a0, dbi.JobLines(), dbs.TrialProgress(values=[], steps_done=4, finish=("succeeded", None)))
    with session_for(db_url) as s:
        row = s.get(Trial, t0.id)
        assert (row.status, row.best_metric, row.result["compute_s"]) == ("succeeded", 1.0, 1.5)
        assert dbs.trial_fields(row)["compute_s"] == 1.5
        assert s.get(Job, t0.job_id).status == "succeeded"
        assert dbs.settle_selection(s, selection_id=sel.id) == "running"
        # trial 1's worker died: its lease runs out and it is queued again, as a trial
        s.execute(Job.__table__.update().where(Job.id == t1.job_id).values(lease_until=None))
        s.commit()
        requeued, _ = dbj.expire_leases(s)
        assert [j.id for j in requeued] == [t1.job_id]
        dbs.sync_trials(s, job_ids=[t1.job_id])
        assert s.get(Trial, t1.id).status == "queued"
        again = dbs.claim_trials(s, trial_ids=[t1.id], owner="o2", worker="w", lease_s=30)
        assert [a.attempt for _, a in again] == [2]
    apply(
        t1,
        again[0][1],
        dbi.JobLines(result=(0, {"steps": 4})),
        dbs.TrialProgress(values=[], finish=("stopped_early", None)),
    )
    with session_for(db_url) as s:
        assert dbs.settle_selection(s, selection_id=sel.id) == "succeeded"
        assert s.get(Trial, t1.id).stopped_early
