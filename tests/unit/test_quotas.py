"""Per-user quotas at claim time, against real SQLite and Postgres (migrated by Alembic)."""

from __future__ import annotations

import threading

from db import jobs as dbj
from db.connection import session_for
from db.quotas import quota_gate, waiting_jobs
from db.users import create_user
from tests.conftest import together

DEFAULTS = {"running_jobs": 4, "ranks": 64, "gpus": 8}


def _jobs(url: str, owner_id: int, n: int, **kw) -> list[int]:
    with session_for(url) as s:
        return [
            dbj.create_job(s, name=f"j{i}", spec={"train": {"steps": 1}}, owner_id=owner_id, **kw).id
            for i in range(n)
        ]


ATTEMPTS: dict[int, dbj.Attempt] = {}


def _gate_and_claim(url: str, job_id: int) -> str | None:
    with session_for(url) as s:
        reason = quota_gate(s, job_id=job_id, defaults=DEFAULTS)
        if reason is None:
            attempt = dbj.claim_job(s, job_id=job_id, owner=f"w{job_id}", worker="w", lease_s=60)
            assert attempt is not None
            ATTEMPTS[job_id] = attempt
        return reason


def _finish(s, job_id: int) -> None:  # noqa: ANN001
    assert dbj.finish_job(s, attempt=ATTEMPTS[job_id], status=dbj.JobStatus.succeeded) is not None


def test_over_quota_waits_with_the_reason_then_runs(db_url: str) -> None:
    with session_for(db_url) as s:
        uid = create_user(s, name="ann", max_running_jobs=1).id
    first, second = _jobs(db_url, uid, 2)
    assert _gate_and_claim(db_url, first) is None
    reason = _gate_and_claim(db_url, second)
    assert reason == "1 of ann's jobs are running, the quota is 1"
    with session_for(db_url) as s:
        job = dbj.get_job(s, second)
        assert (job.status, job.wait_reason) == ("queued", reason)
        assert waiting_jobs(s, owner_id=uid) == [(second, "cpu")]
        _finish(s, first)
    assert _gate_and_claim(db_url, second) is None
    with session_for(db_url) as s:
        job = dbj.get_job(s, second)
        assert (job.status, job.wait_reason) == ("running", None)


def test_ranks_and_gpus_count_across_running_jobs(db_url: str) -> None:
    with session_for(db_url) as s:
        uid = create_user(s, name="bo", max_ranks=4, max_gpus=1).id
    (a,) = _jobs(db_url, uid, 1, world_size=3)
    (b,) = _jobs(db_url, uid, 1, world_size=2)
    assert _gate_and_claim(db_url, a) is None
    assert "use 3 ranks; this one needs 2 more, the quota is 4" in _gate_and_claim(db_url, b)
    with session_for(db_url) as s:
        _finish(s, a)
        g1 = dbj.create_job(s, name="g1", spec={"resources": {"gpus": 1}}, owner_id=uid).id
        g2 = dbj.create_job(s, name="g2", spec={"resources": {"device": "cuda"}}, owner_id=uid).id
    assert _gate_and_claim(db_url, g1) is None
    assert "use 1 GPU(s); this one needs 1 more, the quota is 1" in _gate_and_claim(db_url, g2)


def test_racing_workers_never_exceed_the_quota(db_url: str) -> None:
    with session_for(db_url) as s:
        uid = create_user(s, name="cy", max_running_jobs=2).id
    ids = _jobs(db_url, uid, 6)
    barrier = threading.Barrier(len(ids))
    started: list[int] = []

    def race(job_id: int) -> None:
        barrier.wait()
        if _gate_and_claim(db_url, job_id) is None:
            started.append(job_id)

    together(race, ids)
    assert len(started) == 2
    with session_for(db_url) as s:
        assert len(waiting_jobs(s, owner_id=uid)) == 4


def test_jobs_without_an_owner_have_no_quota(db_url: str) -> None:
    with session_for(db_url) as s:
        job_id = dbj.create_job(s, name="old", spec={}).id
    assert _gate_and_claim(db_url, job_id) is None


def _group(url: str, owner_id: int, *, n: int, devices: int) -> list[int]:
    """A batch of `n` queued trials on `devices` devices; returns the trial ids."""
    from db.selections import add_trials, create_selection

    with session_for(url) as s:
        sel = create_selection(
            s,
            name="sel",
            request={"devices": devices},
            metric="val_loss",
            mode="min",
            scheduler="shard-lrtf",
            owner_id=owner_id,
        )
        trials = add_trials(
            s, selection_id=sel.id, plans=[(i, {}, {"train": {"steps": 1}}) for i in range(n)], queue="cpu"
        )
        return [t.id for t in trials]


def _gate_and_claim_group(url: str, trial_ids: list[int], holder: str) -> str | None:
    from db.quotas import group_quota_gate
    from db.selections import claim_trials

    with session_for(url) as s:
        reason = group_quota_gate(s, trial_ids=trial_ids, defaults=DEFAULTS)
        if reason is None:
            assert len(claim_trials(s, trial_ids=trial_ids, owner=holder, worker="w", lease_s=60)) == len(
                trial_ids
            )
        return reason


def test_a_running_selection_group_counts_as_one_job_of_its_devices(db_url: str) -> None:
    """Four trials in one group (one process on 2 devices) are one running job using 2 ranks: a
    job of 2 more ranks fits a quota of 4, one of 3 does not, and a second group waits for the
    job slots."""
    with session_for(db_url) as s:
        uid = create_user(s, name="cy", max_running_jobs=2, max_ranks=4).id
    group = _group(db_url, uid, n=4, devices=2)
    assert _gate_and_claim_group(db_url, group, "w-group") is None
    (wide,) = _jobs(db_url, uid, 1, world_size=3)
    assert (
        _gate_and_claim(db_url, wide)
        == "cy's running jobs use 2 ranks; this one needs 3 more, the quota is 4"
    )
    (fits,) = _jobs(db_url, uid, 1, world_size=2)
    assert _gate_and_claim(db_url, fits) is None
    second = _group(db_url, uid, n=2, devices=1)
    reason = _gate_and_claim_group(db_url, second, "w-other")
    assert reason == "2 of cy's jobs are running, the quota is 2"
    from db.models import Trial

    with session_for(db_url) as s:
        assert [dbj.get_job(s, j).wait_reason for j in (wide,)] == [
            "cy's running jobs use 2 ranks; this one needs 3 more, the quota is 4"
        ]
        # the group's trials wait queued with the reason (the scheduler places them again)
        for t in second:
            job = dbj.get_job(s, s.get(Trial, t).job_id)
            assert (job.status, job.wait_reason) == ("queued", reason)
        _finish(s, fits)
    assert _gate_and_claim_group(db_url, second, "w-other") is None
