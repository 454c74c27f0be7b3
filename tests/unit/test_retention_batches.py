"""The retention (SHARDYARD_JOB_RETENTION_DAYS) deletes an ended selection batch past it whole:
its trials, their jobs, points, summaries and events, and its folder; a batch still within it, or
with a trial's job still running, stays; plain jobs keep their own rule. On SQLite and Postgres."""

from __future__ import annotations

import random
from datetime import timedelta
from pathlib import Path

from sqlalchemy import func, select, update

from api.retention import cleanup_expired
from bench.scale_seed import Sizes, _seed_selection
from core.settings import Settings
from db.connection import session_for
from db.ingest import SummaryIn, write_summaries
from db.jobs import create_job
from db.models import Job, JobEvent, MetricPoint, MetricSummary, Selection, Trial, utcnow
from db.users import create_user

SIZES = Sizes(
    jobs=100, points=10_000, big_job_points=0, trials=4, trial_steps=20, queued=1, fleet_fill=1, running=1
)


def _batch(url: str, owner: int, *, days_ago: float, running_trial: bool = False) -> tuple[int, list[int]]:
    sid, jobs = _seed_selection(url, sizes=SIZES, owner=owner, rng=random.Random(0))
    with session_for(url) as s:
        s.execute(update(Job).where(Job.id.in_(jobs)).values(status="succeeded"))
        if running_trial:
            s.execute(update(Job).where(Job.id == jobs[0]).values(status="running"))
        ended = utcnow() - timedelta(days=days_ago)
        s.execute(update(Selection).where(Selection.id == sid).values(status="succeeded", finished_at=ended))
        s.add_all(MetricPoint(job_id=j, step=1, name="val_loss", value=1.0, time=0.0) for j in jobs)
        s.add_all(JobEvent(job_id=j, time=0.0, kind="log", message="hi") for j in jobs)
        s.commit()
        write_summaries(s, job_id=jobs[0], attempt=0, upto_id=1, series=[SummaryIn("val_loss", 1, b"", b"")])
    return sid, jobs


def _count(url: str, model: type, *where: object) -> int:
    with session_for(url) as s:
        return s.scalar(select(func.count()).select_from(model).where(*where)) or 0


def test_an_ended_batch_past_the_retention_goes_whole(db_url: str, tmp_path: Path) -> None:
    with session_for(db_url) as s:
        owner = create_user(s, name="u").id
        plain = create_job(s, name="plain", spec={"train": {"steps": 1}}).id
    old, old_jobs = _batch(db_url, owner, days_ago=10)
    recent, _ = _batch(db_url, owner, days_ago=0.5)
    busy, _ = _batch(db_url, owner, days_ago=10, running_trial=True)
    folder = tmp_path / "selections" / str(old)
    folder.mkdir(parents=True)
    (folder / "group-0.json").write_text("{}")
    settings = Settings(database_url=db_url, job_retention_days=1.0, data_dir=tmp_path)
    deleted = cleanup_expired(settings)
    assert sorted(deleted) == sorted(old_jobs)
    assert _count(db_url, Selection, Selection.id == old) == 0
    assert _count(db_url, Trial, Trial.selection_id == old) == 0
    for model in (Job, MetricPoint, JobEvent, MetricSummary):
        column = model.id if model is Job else model.job_id  # type: ignore[attr-defined]
        assert _count(db_url, model, column.in_(old_jobs)) == 0, model
    assert not folder.exists()
    # the recent batch, the one with a trial still running, and the plain queued job stay
    assert _count(db_url, Selection, Selection.id.in_([recent, busy])) == 2
    assert _count(db_url, Trial, Trial.selection_id.in_([recent, busy])) == 2 * SIZES.trials
    assert _count(db_url, Job, Job.id == plain) == 1
    assert cleanup_expired(settings) == []
