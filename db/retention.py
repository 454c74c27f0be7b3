"""Deleting finished jobs: one on request, or every one past its retention. A job's metric points
and events go with it, in the same transaction; a job that is not finished is never deleted. A
selection batch past its retention goes whole: its trials and their jobs, points and events."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import Any

from sqlalchemy import delete, exists, select
from sqlalchemy.orm import Session

from db.jobs import Conflict, get_job
from db.models import TERMINAL, Job, JobEvent, MetricPoint, MetricSummary, Selection, Trial


def _delete_job_rows(session: Session, job_ids: Sequence[int]) -> None:
    """A job's points, summaries and events (the foreign keys cascade too; explicit, so nothing
    depends on SQLite's foreign_keys pragma)."""
    session.execute(delete(MetricPoint).where(MetricPoint.job_id.in_(job_ids)))
    session.execute(delete(MetricSummary).where(MetricSummary.job_id.in_(job_ids)))
    session.execute(delete(JobEvent).where(JobEvent.job_id.in_(job_ids)))


def _delete_rows(session: Session, job_ids: Sequence[int]) -> list[int]:
    """Delete the jobs among `job_ids` that are finished plain jobs, with their points and events;
    the status is checked in the statement itself, so a job re-queued meanwhile stays. Commits."""
    gone = list(
        session.scalars(
            delete(Job)
            .where(Job.id.in_(list(job_ids)), Job.status.in_(list(TERMINAL)), Job.kind == "job")
            .returning(Job.id)
        ).all()
    )
    if gone:
        _delete_job_rows(session, gone)
    session.commit()
    return gone


def delete_job(session: Session, *, job_id: int) -> int | None:
    """Delete one finished job; returns its submitting user's id. NotFound when it does not exist;
    Conflict when it has not finished or is a trial of a selection batch (trials go with their
    batch)."""
    job = get_job(session, job_id)
    if job.kind != "job":
        raise Conflict(f"job {job_id} is a trial of selection {job.selection_id}; it is kept with its batch")
    if job.status not in TERMINAL:
        raise Conflict(
            f"job {job_id} is {job.status}; cancel it and wait until it has ended before deleting it"
        )
    owner_id = job.owner_id
    if not _delete_rows(session, [job_id]):
        session.refresh(job)
        raise Conflict(f"job {job_id} is {job.status} again; it was not deleted")
    return owner_id


def finished_before(session: Session, *, cutoff: datetime, limit: int = 500) -> list[int]:
    """Ids of finished plain jobs that ended before `cutoff`, oldest first."""
    q = (
        select(Job.id)
        .where(Job.status.in_(list(TERMINAL)), Job.kind == "job", Job.finished_at < cutoff)
        .order_by(Job.finished_at)
        .limit(limit)
    )
    return list(session.scalars(q).all())


def delete_jobs(session: Session, *, job_ids: Sequence[int]) -> list[int]:
    """Delete those of `job_ids` that are finished plain jobs; returns the ids deleted."""
    return _delete_rows(session, job_ids) if job_ids else []


def _batch_over() -> Any:
    """A batch that has ended, with every trial's job ended too."""
    live = select(Job.id).where(Job.selection_id == Selection.id, Job.status.not_in(list(TERMINAL)))
    return Selection.status.in_(list(TERMINAL)) & ~exists(live)


def selections_finished_before(session: Session, *, cutoff: datetime, limit: int = 20) -> list[int]:
    """Ids of selection batches that ended before `cutoff` (every trial's job ended), oldest first."""
    q = (
        select(Selection.id)
        .where(_batch_over(), Selection.finished_at < cutoff)
        .order_by(Selection.finished_at)
        .limit(limit)
    )
    return list(session.scalars(q).all())


def delete_selections(session: Session, *, selection_ids: Sequence[int]) -> tuple[list[int], list[int]]:
    """Delete those of `selection_ids` that are over (_batch_over, checked again here, the rows
    locked on PostgreSQL) with their trials and their trials' jobs, points and events, in one
    transaction. Returns (the batches deleted, their trials' job ids). Commits."""
    gone = list(
        session.scalars(
            select(Selection.id).where(Selection.id.in_(list(selection_ids)), _batch_over()).with_for_update()
        ).all()
    )
    jobs: list[int] = []
    if gone:
        jobs = list(session.scalars(select(Job.id).where(Job.selection_id.in_(gone))).all())
        _delete_job_rows(session, jobs)
        session.execute(delete(Trial).where(Trial.selection_id.in_(gone)))
        session.execute(delete(Job).where(Job.id.in_(jobs)))
        session.execute(delete(Selection).where(Selection.id.in_(gone)))
    session.commit()
    return gone, jobs
