"""No trial job outlives its batch in `queued`: two processes growing a batch with the same trial
index at once (the worker ending a group and the reconciler, workers/search.py grow) leave no
trial job behind that no trial points to, on the real SQLite and PostgreSQL; and the API's start
ends one that an older version left, so the queue's depth on /metrics goes back to 0."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from pydantic import SecretStr
from sqlalchemy import select
from sqlalchemy.exc import IntegrityError

from api.main import create_app
from core.settings import Settings
from db import jobs as dbj
from db.connection import session_for
from db.migrate import upgrade
from db.models import Job, JobEvent, JobStatus, Trial
from db.selections import ORPHAN_TRIAL_ERROR, add_trials, create_selection, end_orphan_trial_jobs

SPEC = {"name": "t", "train": {"steps": 4}}


def _batch(url: str) -> int:
    with session_for(url) as s:
        return create_selection(
            s, name="tpe", request={"method": "tpe"}, metric="val_loss", mode="min", scheduler="shard-lrtf"
        ).id


def _plans(*indexes: int) -> list[tuple[int, dict, dict]]:
    return [(i, {"train.lr": 0.1 * (i + 1)}, SPEC) for i in indexes]


def _trial_jobs(url: str) -> tuple[set[int], set[int]]:
    """(ids of the trial jobs, ids of the jobs that trials point to)."""
    with session_for(url) as s:
        jobs = set(s.scalars(select(Job.id).where(Job.kind == "trial")).all())
        pointed = set(s.scalars(select(Trial.job_id)).all())
    return jobs, pointed


def test_a_batch_grown_twice_at_once_leaves_no_trial_job_without_its_trial(db_url: str) -> None:
    sid = _batch(db_url)
    with session_for(db_url) as first, session_for(db_url) as second:
        add_trials(first, selection_id=sid, plans=_plans(0, 1), queue="cpu")
        # the second process asked the same next trials (and one more) from the same replay: its
        # index 1 is taken, and the whole of its growth must go
        with pytest.raises(IntegrityError):
            add_trials(second, selection_id=sid, plans=_plans(1, 2), queue="cpu")
        second.rollback()
        with pytest.raises(IntegrityError):
            add_trials(second, selection_id=sid, plans=_plans(0), queue="cpu")
        second.rollback()
    jobs, pointed = _trial_jobs(db_url)
    assert len(jobs) == 2 and jobs == pointed, (jobs, pointed)
    with session_for(db_url) as s:
        assert end_orphan_trial_jobs(s) == []


def test_the_check_ends_an_orphan_and_nothing_else(db_url: str) -> None:
    sid = _batch(db_url)
    with session_for(db_url) as s:
        (kept,) = add_trials(s, selection_id=sid, plans=_plans(0), queue="cpu")
        orphan = dbj.create_job(s, name="t#1", spec=SPEC, steps=4, kind="trial", selection_id=sid).id
        plain = dbj.create_job(s, name="job", spec=SPEC, steps=4).id
        assert end_orphan_trial_jobs(s) == [orphan]
        assert end_orphan_trial_jobs(s) == []  # idempotent
        job = dbj.get_job(s, orphan)
        s.refresh(job)
        assert job.status == JobStatus.cancelled and job.error == ORPHAN_TRIAL_ERROR
        assert job.finished_at is not None
        ev = s.scalars(select(JobEvent).where(JobEvent.job_id == orphan).order_by(JobEvent.id.desc())).first()
        assert ev is not None and ev.message == "cancelled" and ev.data["by"] == "orphan check"
        assert dbj.get_job(s, kept.job_id).status == JobStatus.queued
        assert dbj.get_job(s, plain).status == JobStatus.queued


@pytest.fixture
def sqlite_url(tmp_path: Path) -> Iterator[str]:
    url = f"sqlite:///{tmp_path / 'api.db'}"
    upgrade(url)
    yield url


def _queue_depth(client: TestClient) -> float:
    text = client.get("/metrics").text
    rows = [ln for ln in text.splitlines() if ln.startswith('shardyard_queue_depth{queue="cpu"}')]
    return float(rows[0].split()[-1]) if rows else 0.0


def test_the_api_start_ends_an_orphan_trial_job(sqlite_url: str, tmp_path: Path) -> None:
    sid = _batch(sqlite_url)
    with session_for(sqlite_url) as s:
        orphan = dbj.create_job(s, name="t#3", spec=SPEC, steps=4, kind="trial", selection_id=sid).id
    token = "orphan-check-admin-token"
    settings = Settings(
        database_url=sqlite_url,
        data_dir=tmp_path,
        embedded_scheduler=False,
        admin_token=SecretStr(token),
        trusted_hosts=["testserver"],
        stall_log_s=0,
    )
    with TestClient(create_app(settings)) as client:
        client.headers["Authorization"] = f"Bearer {token}"
        job = client.get(f"/api/jobs/{orphan}").json()
        assert job["status"] == "cancelled" and job["error"] == ORPHAN_TRIAL_ERROR, job
        assert _queue_depth(client) == 0.0
