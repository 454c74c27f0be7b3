"""Data functions for jobs, their metrics and events, and worker heartbeats.

Each function is one unit of work: it commits what it changed. Routes and workers call these and
map the domain errors to status codes or task outcomes.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import func, insert, select, update
from sqlalchemy.orm import Session

from db.models import TERMINAL, Job, JobEvent, JobStatus, MetricPoint, User, WorkerBeat, utcnow


class NotFound(LookupError):
    pass


class Conflict(RuntimeError):
    pass


def aware(dt: datetime | None) -> datetime | None:
    """SQLite hands back naive datetimes; every stored time is UTC."""
    if dt is not None and dt.tzinfo is None:
        return dt.replace(tzinfo=UTC)
    return dt


# ---- jobs -------------------------------------------------------------------------------------


def create_job(
    session: Session,
    *,
    name: str,
    spec: dict[str, Any],
    priority: int = 0,
    queue: str = "cpu",
    world_size: int = 1,
    steps: int = 0,
    kind: str = "job",
    selection_id: int | None = None,
    owner_id: int | None = None,
    actor: str | None = None,
) -> Job:
    """`actor` (who submitted it) goes into the first status event."""
    job = Job(
        name=name,
        spec=spec,
        priority=priority,
        queue=queue,
        world_size=world_size,
        steps=steps,
        kind=kind,
        selection_id=selection_id,
        owner_id=owner_id,
        status=JobStatus.queued,
        enqueued_at=utcnow(),  # the caller sends the message next; mark_unsent undoes this
    )
    session.add(job)
    session.flush()
    by = {"by": actor} if actor else None
    session.add(JobEvent(job_id=job.id, time=time.time(), kind="status", message="queued", data=by))
    session.commit()
    return job


def get_job(session: Session, job_id: int) -> Job:
    job = session.get(Job, job_id)
    if job is None:
        raise NotFound(f"job {job_id} does not exist")
    return job


def list_jobs(
    session: Session,
    *,
    status: str | None = None,
    kind: str | None = "job",
    owner_id: int | None = None,
    owner: str | None = None,
    name: str | None = None,
    limit: int = 50,
    offset: int = 0,
) -> tuple[Sequence[Job], int]:
    """One page, newest first, and the count of all matches. `owner_id` restricts to one user's
    jobs (a non-admin's view); `owner` filters by user name; `name` matches a substring."""
    where = []
    if status:
        where.append(Job.status == status)
    if kind:
        where.append(Job.kind == kind)
    if owner_id is not None:
        where.append(Job.owner_id == owner_id)
    if owner:
        where.append(Job.owner_id == select(User.id).where(User.name == owner).scalar_subquery())
    if name:
        where.append(Job.name.icontains(name, autoescape=True))
    total = session.scalar(select(func.count(Job.id)).where(*where)) or 0
    rows = session.scalars(
        select(Job).where(*where).order_by(Job.id.desc()).limit(limit).offset(offset)
    ).all()
    return rows, total


def mark_unsent(session: Session, *, job_id: int, reason: str) -> None:
    """The message could not be sent: leave the job to the reconciler at once."""
    session.execute(update(Job).where(Job.id == job_id).values(enqueued_at=None))
    session.add(
        JobEvent(
            job_id=job_id, time=time.time(), kind="log", message=f"broker unavailable, will retry: {reason}"
        )
    )
    session.commit()


def mark_enqueued(session: Session, *, job_ids: Iterable[int]) -> None:
    ids = list(job_ids)
    if ids:
        session.execute(update(Job).where(Job.id.in_(ids)).values(enqueued_at=utcnow()))
        session.commit()


def claim_job(session: Session, *, job_id: int, worker: str) -> bool:
    """queued -> running, atomically. False when another delivery (or a cancel) got there first:
    this conditional update is what makes a twice-delivered message run the job once."""
    res = session.execute(
        update(Job)
        .where(Job.id == job_id, Job.status == JobStatus.queued, Job.cancel_requested.is_(False))
        .values(
            status=JobStatus.running,
            started_at=utcnow(),
            worker=worker,
            attempts=Job.attempts + 1,
        )
    )
    session.commit()
    return res.rowcount == 1


def finish_job(
    session: Session,
    *,
    job_id: int,
    status: JobStatus,
    error: str | None = None,
    result: dict[str, Any] | None = None,
) -> None:
    """running -> terminal. The caller records the status event (and publishes it)."""
    assert status in TERMINAL, status
    session.execute(
        update(Job)
        .where(Job.id == job_id)
        .values(status=status, error=error, result=result, finished_at=utcnow())
    )
    session.commit()


def requeue_job(session: Session, *, job_id: int, reason: str) -> None:
    """running -> queued after an infrastructure failure (the worker died), for a retry."""
    session.execute(
        update(Job)
        .where(Job.id == job_id, Job.status == JobStatus.running)
        .values(status=JobStatus.queued, worker=None, started_at=None)
    )
    session.add(
        JobEvent(job_id=job_id, time=time.time(), kind="status", message="queued", data={"reason": reason})
    )
    session.commit()


def request_cancel(session: Session, *, job_id: int, actor: str | None = None) -> Job:
    """A queued job is cancelled at once; a running one is asked to stop (the worker finishes it).
    `actor` (who asked) is recorded in the event."""
    by = {"by": actor} if actor else None
    job = get_job(session, job_id)
    if job.status in TERMINAL:
        raise Conflict(f"job {job_id} is already {job.status}; only queued or running jobs can be cancelled")
    res = session.execute(
        update(Job)
        .where(Job.id == job_id, Job.status == JobStatus.queued)
        .values(status=JobStatus.cancelled, cancel_requested=True, finished_at=utcnow())
    )
    if res.rowcount == 1:
        session.add(JobEvent(job_id=job_id, time=time.time(), kind="status", message="cancelled", data=by))
    else:
        session.execute(update(Job).where(Job.id == job_id).values(cancel_requested=True))
        message = f"cancel requested by {actor}" if actor else "cancel requested"
        session.add(JobEvent(job_id=job_id, time=time.time(), kind="log", message=message, data=by))
    session.commit()
    session.refresh(job)
    return job


def cancel_requested(session: Session, *, job_id: int) -> bool:
    return bool(session.scalar(select(Job.cancel_requested).where(Job.id == job_id)))


def stale_queued_jobs(session: Session, *, older_than_s: float) -> list[Job]:
    """Queued jobs whose message was sent long ago: the broker may have lost it."""
    cutoff = utcnow() - timedelta(seconds=older_than_s)
    q = select(Job).where(
        Job.status == JobStatus.queued,
        Job.cancel_requested.is_(False),
        (Job.enqueued_at.is_(None)) | (Job.enqueued_at < cutoff),
        Job.created_at < cutoff,
    )
    return list(session.scalars(q).all())


def orphaned_running_jobs(session: Session, *, alive: set[str]) -> list[Job]:
    """Running jobs whose worker has no fresh heartbeat (it died or was killed)."""
    q = select(Job).where(Job.status == JobStatus.running, Job.kind == "job")
    return [j for j in session.scalars(q).all() if j.worker not in alive]


# ---- metrics and events ---------------------------------------------------------------------


def add_metric_points(
    session: Session, *, job_id: int, points: Sequence[tuple[int, str, float, float]]
) -> list[int]:
    """Insert (step, name, value, time) rows in one statement; returns their ids in order."""
    if not points:
        return []
    rows = [{"job_id": job_id, "step": s, "name": n, "value": v, "time": t} for s, n, v, t in points]
    ids = session.scalars(
        insert(MetricPoint).returning(MetricPoint.id, sort_by_parameter_order=True), rows
    ).all()
    top = max(p[0] for p in points)
    session.execute(update(Job).where(Job.id == job_id, Job.step < top).values(step=top))
    losses = [p for p in points if p[1] == "loss"]
    if losses:
        session.execute(update(Job).where(Job.id == job_id).values(last_loss=max(losses)[2]))
    session.commit()
    return list(ids)


def add_event(
    session: Session,
    *,
    job_id: int,
    kind: str,
    message: str,
    data: dict[str, Any] | None = None,
    at: float | None = None,
) -> int:
    ev = JobEvent(job_id=job_id, time=at or time.time(), kind=kind, message=message, data=data)
    session.add(ev)
    session.commit()
    return ev.id


def metric_series(
    session: Session, *, job_id: int, names: Sequence[str] | None = None, since_step: int = 0
) -> dict[str, tuple[list[int], list[float]]]:
    q = select(MetricPoint.name, MetricPoint.step, MetricPoint.value).where(
        MetricPoint.job_id == job_id, MetricPoint.step >= since_step
    )
    if names:
        q = q.where(MetricPoint.name.in_(list(names)))
    out: dict[str, tuple[list[int], list[float]]] = {}
    for name, step, value in session.execute(q.order_by(MetricPoint.name, MetricPoint.step, MetricPoint.id)):
        steps, values = out.setdefault(name, ([], []))
        steps.append(step)
        values.append(value)
    return out


def metrics_after(
    session: Session, *, job_id: int, after_id: int, limit: int = 5000
) -> Sequence[MetricPoint]:
    q = (
        select(MetricPoint)
        .where(MetricPoint.job_id == job_id, MetricPoint.id > after_id)
        .order_by(MetricPoint.id)
        .limit(limit)
    )
    return session.scalars(q).all()


def events_after(
    session: Session,
    *,
    job_id: int,
    after_id: int = 0,
    kinds: Sequence[str] | None = None,
    limit: int = 5000,
) -> Sequence[JobEvent]:
    q = select(JobEvent).where(JobEvent.job_id == job_id, JobEvent.id > after_id)
    if kinds:
        q = q.where(JobEvent.kind.in_(list(kinds)))
    return session.scalars(q.order_by(JobEvent.id).limit(limit)).all()


def latest_event(session: Session, *, job_id: int, message: str) -> JobEvent | None:
    q = (
        select(JobEvent)
        .where(JobEvent.job_id == job_id, JobEvent.kind == "event", JobEvent.message == message)
        .order_by(JobEvent.id.desc())
        .limit(1)
    )
    return session.scalars(q).first()


# ---- workers ----------------------------------------------------------------------------------


def record_heartbeat(
    session: Session,
    *,
    name: str,
    hostname: str,
    queues: list[str],
    devices: list[dict[str, Any]],
    host: dict[str, int] | None = None,
) -> None:
    """`host` is the machine's inventory for admission ({ram_bytes, slots, cpus})."""
    inventory = {"devices": devices, "host": host or {}}
    beat = session.get(WorkerBeat, name)
    if beat is None:
        session.add(WorkerBeat(name=name, hostname=hostname, queues={"queues": queues}, devices=inventory))
    else:
        beat.last_seen = utcnow()
        beat.queues = {"queues": queues}
        beat.devices = inventory
    session.commit()


def live_workers(session: Session, *, within_s: float) -> list[WorkerBeat]:
    cutoff = utcnow() - timedelta(seconds=within_s)
    return [w for w in session.scalars(select(WorkerBeat)).all() if aware(w.last_seen) >= cutoff]
