"""Data functions for jobs, their metrics and events, and worker heartbeats.

Each function is one unit of work: it commits what it changed. Routes and workers call these and
map the domain errors to status codes or task outcomes.
"""

from __future__ import annotations

import itertools
import operator
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import case, delete, exists, func, insert, select, text, update
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.orm import Session

from db.models import TERMINAL, Job, JobEvent, JobStatus, MetricPoint, Reservation, User, WorkerBeat, utcnow


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


@dataclass(frozen=True, slots=True)
class Attempt:
    """One claim of a job: every write it makes is fenced by (job_id, attempt, owner)."""

    job_id: int
    attempt: int
    owner: str


def db_now(session: Session) -> datetime:
    """The database's clock, not this machine's: leases are judged by one clock for every worker."""
    if session.get_bind().dialect.name == "sqlite":
        raw = session.scalar(text("SELECT strftime('%Y-%m-%d %H:%M:%f', 'now')"))
        return datetime.fromisoformat(str(raw)).replace(tzinfo=UTC)
    return aware(session.scalar(text("SELECT clock_timestamp()")))  # type: ignore[return-value]


def _fence(attempt: Attempt) -> Any:
    return (Job.id == attempt.job_id) & (Job.attempts == attempt.attempt) & (Job.owner == attempt.owner)


def set_run_note(session: Session, *, attempts: list[Attempt], note: str | None) -> None:
    """What a running attempt waits on before it trains (`preparing environment`), shown as the
    job's wait_reason; None clears it. Fenced: a stale attempt changes nothing."""
    for attempt in attempts:
        session.execute(update(Job).where(_fence(attempt)).values(wait_reason=note))


def _claimable(now: datetime, owner: str) -> Any:
    """Queued, or running under a lease that ran out (or that this very process holds: a retry
    of its own task re-claims instead of skipping)."""
    expired = Job.lease_until.is_(None) | (Job.lease_until < now) | (Job.owner == owner)
    return (Job.status == JobStatus.queued) | ((Job.status == JobStatus.running) & expired)


def free_job_reservations(session: Session, *, job_id: int) -> None:
    """The job's slots go back to the pool (inside the caller's transaction)."""
    session.execute(delete(Reservation).where(Reservation.job_id == job_id))


def _reserved_here(job_id: int, worker: str) -> Any:
    return exists().where(
        Reservation.job_id == job_id, Reservation.worker == worker, Reservation.node_rank == 0
    )


def reserved_here(session: Session, *, job_id: int, worker: str) -> bool:
    """The scheduler placed node 0 of job `job_id` on `worker`."""
    return bool(session.scalar(select(_reserved_here(job_id, worker))))


def claim_job(
    session: Session,
    *,
    job_id: int,
    owner: str,
    worker: str,
    lease_s: float,
    kind: str = "job",
    reserved: bool = False,
    now: datetime | None = None,
) -> Attempt | None:
    """Take the lease of job `job_id` for `owner` (one worker process start), atomically: one
    conditional UPDATE, so of many racing deliveries exactly one wins. None when the job is taken
    (a live lease), ended, cancelled, or of another kind (a trial runs only inside its batch).
    `reserved`: only when the scheduler reserved node 0 of the job on `worker` (a task for a job
    placed elsewhere is skipped); the reservation records the claim. `now`: the database time
    to start it at (the trials of one group share their claim's)."""
    if now is None:
        now = db_now(session)
    where = [Job.id == job_id, Job.kind == kind, Job.cancel_requested.is_(False), _claimable(now, owner)]
    if reserved:
        where.append(_reserved_here(job_id, worker))
    got = session.execute(
        update(Job)
        .where(*where)
        .values(
            status=JobStatus.running,
            started_at=now,
            worker=worker,
            owner=owner,
            lease_until=now + timedelta(seconds=lease_s),
            applied_seq=-1,
            attempts=Job.attempts + 1,
        )
        .returning(Job.attempts)
        .execution_options(synchronize_session=False)
    ).first()
    if got and reserved:
        session.execute(
            update(Reservation)
            .where(Reservation.job_id == job_id, Reservation.node_rank == 0)
            .values(claimed_at=now, owner=owner)
        )
    if got:
        data = {"worker": worker, "attempt": got[0]}
        session.add(JobEvent(job_id=job_id, time=time.time(), kind="status", message="running", data=data))
    session.commit()
    return Attempt(job_id=job_id, attempt=got[0], owner=owner) if got else None


def lease_left_s(session: Session, *, job_id: int) -> float | None:
    """Seconds until the running job's lease runs out (<= 0: reclaimable); None when not running."""
    job = session.get(Job, job_id)
    if job is None or job.status != JobStatus.running or job.lease_until is None:
        return None
    return (aware(job.lease_until) - db_now(session)).total_seconds()  # type: ignore[operator]


@dataclass(slots=True)
class JobLines:
    """One job's share of a relay batch, each line with its protocol sequence number."""

    metrics: list[tuple[int | None, int, str, float, float]] = field(default_factory=list)
    """(seq, step, name, value, time)"""
    events: list[tuple[int | None, str, str, dict[str, Any] | None, float]] = field(default_factory=list)
    """(seq, kind, message, data, time); kind is log or event; seq None for a stray text line"""
    result: tuple[int | None, dict[str, Any]] | None = None
    """(seq, data)"""

    def empty(self) -> bool:
        return not (self.metrics or self.events or self.result)


@dataclass(slots=True)
class Applied:
    """What one batch wrote for one job: rows with their ids, for the live channels."""

    metrics: list[dict[str, Any]] = field(default_factory=list)
    events: list[dict[str, Any]] = field(default_factory=list)
    result: dict[str, Any] | None = None


def _upsert_points(session: Session, rows: list[dict[str, Any]]) -> dict[tuple[str, int], int]:
    """Insert-or-update on (job, name, step); returns each row's id by (name, step)."""
    dialect = session.get_bind().dialect.name
    ins = (sqlite_insert if dialect == "sqlite" else pg_insert)(MetricPoint)
    stmt = ins.on_conflict_do_update(
        index_elements=["job_id", "name", "step"],
        set_={"value": ins.excluded.value, "time": ins.excluded.time},
    ).returning(MetricPoint.id, MetricPoint.name, MetricPoint.step)
    return {(n, st): i for i, n, st in session.execute(stmt, rows)}


def apply_lines(
    session: Session,
    *,
    attempt: Attempt,
    lines: JobLines,
    lease_s: float,
    now: datetime,
    fence: Any = None,
    renew: bool = True,
    run_seconds: float | None = None,
) -> Applied | None:
    """Apply one job's lines of a batch inside the caller's transaction and renew its lease (and
    record `run_seconds`, the job's run time over all its attempts, when given).
    None when the attempt is fenced off (re-queued, failed by an operator, taken by a newer
    attempt): then nothing of it is written. Lines at or below the applied sequence number are
    skipped, so a batch retried after a commit that did go through changes nothing. `fence` (the
    job owner's by default) and `renew` (the job's lease) are for a gang's nodes (apply_gang_lines)."""
    fence = _fence(attempt) if fence is None else fence
    seen = session.scalar(select(Job.applied_seq).where(fence))
    if seen is None:
        return None
    out = Applied()
    fresh = lambda seq: seq is None or seq > seen  # noqa: E731 - lines with no number always apply
    metrics = [m for m in lines.metrics if fresh(m[0])]
    events = [e for e in lines.events if fresh(e[0])]
    result = lines.result if lines.result and fresh(lines.result[0]) else None
    seqs = [x[0] for x in (*metrics, *events, *([result] if result else [])) if x[0] is not None]
    top_seq = max([seen, *seqs])
    ckpts: list[int] = []
    values: dict[str, Any] = {"applied_seq": top_seq}
    if renew:
        values["lease_until"] = now + timedelta(seconds=lease_s)
    if run_seconds is not None:
        values["run_seconds"] = run_seconds
    if metrics:
        latest = {(n, st): (st, n, v, t) for _, st, n, v, t in metrics}  # one row per key per statement
        rows = [
            {"job_id": attempt.job_id, "step": st, "name": n, "value": v, "time": t}
            for st, n, v, t in latest.values()
        ]
        ids = _upsert_points(session, rows)
        out.metrics = [{"id": ids[(r["name"], r["step"])], **r} for r in rows]
        top = max(st for st, *_ in latest.values())
        values["step"] = case((Job.step < top, top), else_=Job.step)
        if losses := [(st, v) for st, n, v, _ in latest.values() if n == "loss"]:
            values["last_loss"] = max(losses)[1]
    if events:
        rows = [
            {"job_id": attempt.job_id, "time": t, "kind": k, "message": m, "data": d}
            for _, k, m, d, t in events
        ]
        ids = session.scalars(
            insert(JobEvent).returning(JobEvent.id, sort_by_parameter_order=True), rows
        ).all()
        out.events = [{"id": i, **r} for i, r in zip(ids, rows, strict=True)]
        ckpts += [
            d["step"]
            for _, k, m, d, _ in events
            if k == "event" and m == "checkpoint" and d and isinstance(d.get("step"), int)
        ]
    if result is not None:
        values["result"] = out.result = result[1]
        if isinstance(result[1].get("steps"), int):
            ckpts.append(result[1]["steps"])
    if ckpts:
        values["applied_step"] = case((Job.applied_step < max(ckpts), max(ckpts)), else_=Job.applied_step)
    res = session.execute(update(Job).where(fence, Job.applied_seq == seen).values(**values))
    return out if res.rowcount == 1 else None


def renew_lease(session: Session, *, attempt: Attempt, lease_s: float) -> bool:
    """Extend the lease; False when the attempt was fenced off."""
    now = db_now(session)
    res = session.execute(
        update(Job).where(_fence(attempt)).values(lease_until=now + timedelta(seconds=lease_s))
    )
    session.commit()
    return res.rowcount == 1


def finish_job(
    session: Session,
    *,
    attempt: Attempt,
    status: JobStatus,
    error: str | None = None,
    result: dict[str, Any] | None = None,
) -> int | None:
    """running -> terminal for this attempt only, with its status event, in one transaction.
    `result` None keeps the one already stored when it arrived. Returns the event's id, or None
    when the attempt was fenced off (then nothing changes)."""
    assert status in TERMINAL, status
    values: dict[str, Any] = {
        "status": status,
        "error": error,
        "finished_at": utcnow(),
        "owner": None,
        "lease_until": None,
    }
    if result is not None:
        values["result"] = result
    res = session.execute(update(Job).where(_fence(attempt)).values(**values, preempt_requested=False))
    if res.rowcount != 1:
        session.rollback()
        return None
    free_job_reservations(session, job_id=attempt.job_id)
    ev = JobEvent(
        job_id=attempt.job_id, time=time.time(), kind="status", message=str(status), data={"error": error}
    )
    session.add(ev)
    session.commit()
    return ev.id


def release_job(session: Session, *, attempt: Attempt, reason: str) -> bool:
    """This attempt gives the job back (warm shutdown): running -> queued, to be resumed from its
    checkpoint by whoever claims it next. False when it was fenced off."""
    res = session.execute(
        update(Job)
        .where(_fence(attempt), Job.status == JobStatus.running)
        .values(
            status=JobStatus.queued, owner=None, lease_until=None, enqueued_at=None, preempt_requested=False
        )
    )
    if res.rowcount != 1:
        session.rollback()
        return False
    free_job_reservations(session, job_id=attempt.job_id)
    session.add(
        JobEvent(
            job_id=attempt.job_id, time=time.time(), kind="status", message="queued", data={"reason": reason}
        )
    )
    session.commit()
    return True


def restart_reasons(session: Session, *, job_id: int) -> list[tuple[int | None, str]]:
    """(attempt, reason) of every attempt of the job that failed for the infrastructure and was
    retried, oldest first: the `queued` status events that carry a `restart` number."""
    rows = session.scalars(
        select(JobEvent.data)
        .where(JobEvent.job_id == job_id, JobEvent.kind == "status", JobEvent.message == "queued")
        .order_by(JobEvent.id)
    ).all()
    return [
        (d.get("attempt"), str(d.get("reason")))
        for d in rows
        if isinstance(d, dict) and (d.get("restart") or d.get("gang_restart"))
    ]


def restarts_spent_error(
    session: Session, *, job_id: int, attempt: int, reason: str, max_restarts: int
) -> str:
    """The error of a job whose infrastructure failures used up its max_restarts: every
    attempt's reason, the last one too."""
    if max_restarts == 0:
        return f"{reason} (not retried: max_restarts is 0)"
    reasons = [*restart_reasons(session, job_id=job_id), (attempt, reason)]
    listed = "; ".join(f"attempt {a}: {r}" if a is not None else r for a, r in reasons)
    return f"{len(reasons)} attempts failed for the infrastructure (max_restarts={max_restarts}): {listed}"


def _restart_values(
    job: Job, *, reason: str, max_restarts: int
) -> tuple[dict[str, Any], str, dict[str, Any]]:
    """(column values, status, event data) of a job whose attempt failed for the infrastructure:
    back to the queue with its restart counted, or failed once max_restarts is used up."""
    used = job.restarts or 0
    values: dict[str, Any] = {
        "owner": None,
        "lease_until": None,
        "enqueued_at": None,
        "preempt_requested": False,
    }
    if used < max_restarts:
        values.update(status=JobStatus.queued, restarts=used + 1)
        data = {"reason": reason, "restart": used + 1, "max_restarts": max_restarts, "attempt": job.attempts}
        return values, JobStatus.queued, data
    return values, JobStatus.failed, {}


def restart_job(session: Session, *, attempt: Attempt, reason: str, max_restarts: int) -> str | None:
    """This attempt failed for the infrastructure (a rank killed by a signal): running -> queued,
    to resume from its checkpoint, counted in `restarts`; once `max_restarts` are used, running ->
    failed with every attempt's reason. Returns the new status, or None when it was fenced off."""
    job = session.scalars(select(Job).where(_fence(attempt), Job.status == JobStatus.running)).first()
    if job is None:
        session.rollback()
        return None
    values, status, data = _restart_values(job, reason=reason, max_restarts=max_restarts)
    if status == JobStatus.failed:
        error = restarts_spent_error(
            session, job_id=job.id, attempt=attempt.attempt, reason=reason, max_restarts=max_restarts
        )
        values.update(status=status, error=error, finished_at=utcnow())
        data = {"error": error}
    res = session.execute(
        update(Job).where(_fence(attempt), Job.status == JobStatus.running).values(**values)
    )
    if res.rowcount != 1:
        session.rollback()
        return None
    free_job_reservations(session, job_id=attempt.job_id)
    session.add(JobEvent(job_id=job.id, time=time.time(), kind="status", message=str(status), data=data))
    session.commit()
    return str(status)


def expire_leases(
    session: Session,
    *,
    gang_restarts: int = 3,
    max_restarts: Callable[[dict[str, Any]], int] | None = None,
) -> tuple[list[Job], list[Job]]:
    """Running jobs (and trials) whose lease ran out by database time: the owner is gone or cut
    off. A cancel that was asked ends them `cancelled`; the rest go back to `queued` with no
    message on record, for the reconciler to send. A multi-node job goes back whole when its lease
    or any node's ran out (expire_gangs). `max_restarts(spec)`: a job (not a trial: its selection
    group is retried as one) counts the lost attempt against it, and past it ends `failed` with
    every attempt's reason; None counts nothing. Returns (re-queued, cancelled)."""
    now = db_now(session)
    requeued, cancelled = expire_gangs(session, now=now, gang_restarts=gang_restarts)
    gone = session.scalars(
        select(Job).where(
            Job.status == JobStatus.running, Job.lease_until.is_(None) | (Job.lease_until < now)
        )
    ).all()
    for job in gone:
        cancel = job.cancel_requested
        why = f"the lease of {job.worker} (attempt {job.attempts}) ran out: the worker was lost"
        values: dict[str, Any] = {
            "status": JobStatus.cancelled if cancel else JobStatus.queued,
            "owner": None,
            "lease_until": None,
            "enqueued_at": None,
            "finished_at": utcnow() if cancel else None,
            "preempt_requested": False,
        }
        data: dict[str, Any] = {"reason": why}
        if not cancel and max_restarts is not None and job.kind == "job":
            limit = max_restarts(job.spec or {})
            values, status, data = _restart_values(job, reason=why, max_restarts=limit)
            if status == JobStatus.failed:
                error = restarts_spent_error(
                    session, job_id=job.id, attempt=job.attempts, reason=why, max_restarts=limit
                )
                values.update(status=status, error=error, finished_at=utcnow())
                data = {"error": error}
        res = session.execute(
            update(Job)
            .where(Job.id == job.id, Job.attempts == job.attempts, Job.status == JobStatus.running)
            .values(**values)
        )
        if res.rowcount != 1:
            continue
        free_job_reservations(session, job_id=job.id)
        msg = str(values["status"])
        session.add(JobEvent(job_id=job.id, time=time.time(), kind="status", message=msg, data=data))
        if msg == JobStatus.queued:
            requeued.append(job)
        elif msg == JobStatus.cancelled:
            cancelled.append(job)
    session.commit()
    return requeued, cancelled


def fail_job(session: Session, *, job_id: int, reason: str, actor: str | None = None) -> Job:
    """An operator ends a job `failed` whatever its state; a running attempt is fenced off (its
    worker notices at its next batch and kills the trainer)."""
    job = get_job(session, job_id)
    if job.status in TERMINAL:
        raise Conflict(f"job {job_id} is already {job.status}")
    session.execute(
        update(Job)
        .where(Job.id == job_id)
        .values(status=JobStatus.failed, error=reason, finished_at=utcnow(), owner=None, lease_until=None)
    )
    free_job_reservations(session, job_id=job_id)
    session.add(
        JobEvent(
            job_id=job_id,
            time=time.time(),
            kind="status",
            message="failed",
            data={"error": reason, **({"by": actor} if actor else {})},
        )
    )
    session.commit()
    session.refresh(job)
    return job


def requeue_job(session: Session, *, job_id: int, reason: str, actor: str | None = None) -> Job:
    """An operator puts a job back in the queue: a running one (its attempt fenced off), or an
    ended one to run again (resuming from its checkpoint). The caller sends the message."""
    job = get_job(session, job_id)
    if job.status == JobStatus.queued:
        raise Conflict(f"job {job_id} is already queued")
    session.execute(
        update(Job)
        .where(Job.id == job_id)
        .values(
            status=JobStatus.queued,
            owner=None,
            lease_until=None,
            cancel_requested=False,
            error=None,
            finished_at=None,
            enqueued_at=utcnow(),
            preempt_requested=False,
        )
    )
    free_job_reservations(session, job_id=job_id)
    session.add(
        JobEvent(
            job_id=job_id,
            time=time.time(),
            kind="status",
            message="queued",
            data={"reason": reason, **({"by": actor} if actor else {})},
        )
    )
    session.commit()
    session.refresh(job)
    return job


def request_cancel(session: Session, *, job_id: int, actor: str | None = None) -> Job:
    """A queued job, or a running one whose owner is gone, is cancelled at once; a running one
    with a live lease is asked to stop (its worker ends it). `actor` (who asked) is recorded in the
    event."""
    by = {"by": actor} if actor else None
    job = get_job(session, job_id)
    if job.status in TERMINAL:
        raise Conflict(f"job {job_id} is already {job.status}; only queued or running jobs can be cancelled")
    # queued, or running under a lease that ran out (its owner is gone): cancelled at once
    now = db_now(session)
    gone = (Job.status == JobStatus.running) & (Job.lease_until.is_(None) | (Job.lease_until < now))
    res = session.execute(
        update(Job)
        .where(Job.id == job_id, (Job.status == JobStatus.queued) | gone)
        .values(
            status=JobStatus.cancelled,
            cancel_requested=True,
            finished_at=utcnow(),
            owner=None,
            lease_until=None,
        )
        .execution_options(synchronize_session="fetch")
    )
    if res.rowcount == 1:
        free_job_reservations(session, job_id=job_id)
        session.add(JobEvent(job_id=job_id, time=time.time(), kind="status", message="cancelled", data=by))
    else:
        session.execute(update(Job).where(Job.id == job_id).values(cancel_requested=True))
        message = f"cancel requested by {actor}" if actor else "cancel requested"
        session.add(JobEvent(job_id=job_id, time=time.time(), kind="log", message=message, data=by))
    session.commit()
    session.refresh(job)
    return job


def stop_flags(session: Session, *, job_id: int) -> tuple[bool, bool]:
    """(cancel requested, preemption requested) of a job."""
    row = session.execute(select(Job.cancel_requested, Job.preempt_requested).where(Job.id == job_id)).first()
    return (bool(row[0]), bool(row[1])) if row else (False, False)


def cancel_requested(session: Session, *, job_id: int) -> bool:
    return bool(session.scalar(select(Job.cancel_requested).where(Job.id == job_id)))


def stale_queued_jobs(session: Session, *, older_than_s: float) -> list[Job]:
    """Queued jobs (and trials) with no message on record, or whose message was sent long ago: the
    broker may have lost it."""
    cutoff = utcnow() - timedelta(seconds=older_than_s)
    q = select(Job).where(
        Job.status == JobStatus.queued,
        Job.cancel_requested.is_(False),
        # never sent (broker down, a lease ran out, a warm shutdown gave it back): send it now
        Job.enqueued_at.is_(None) | ((Job.enqueued_at < cutoff) & (Job.created_at < cutoff)),
    )
    return list(session.scalars(q).all())


# ---- metrics and events ---------------------------------------------------------------------


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
    # the driver's own tuples (name, step and value need no conversion on SQLite or Postgres),
    # grouped by name in bulk: a long job has tens of thousands of points, and making an ORM row
    # of each held the API's interpreter lock for a large share of every read (bench/api_load.py)
    result = session.connection().execute(q.order_by(MetricPoint.name, MetricPoint.step, MetricPoint.id))
    try:
        rows = result.cursor.fetchall()
    finally:
        result.close()
    out: dict[str, tuple[list[int], list[float]]] = {}
    for name, group in itertools.groupby(rows, key=operator.itemgetter(0)):
        points = list(group)
        steps, values = out.setdefault(name, ([], []))  # (a name comes in one run: ordered by it)
        steps += [p[1] for p in points]
        values += [p[2] for p in points]
    return out


def metric_rows(session: Session, *, job_id: int, after_id: int = 0) -> list[tuple[int, str, int, float]]:
    """(id, name, step, value) of a job's points with an id above `after_id`, ordered by name and
    step, as the driver's tuples: what the API's per-job series cache reads (api/series.py)."""
    q = (
        select(MetricPoint.id, MetricPoint.name, MetricPoint.step, MetricPoint.value)
        .where(MetricPoint.job_id == job_id, MetricPoint.id > after_id)
        .order_by(MetricPoint.name, MetricPoint.step, MetricPoint.id)
    )
    result = session.connection().execute(q)
    try:
        return result.cursor.fetchall()
    finally:
        result.close()


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


def last_status_event(session: Session, *, job_id: int) -> JobEvent | None:
    q = (
        select(JobEvent)
        .where(JobEvent.job_id == job_id, JobEvent.kind == "status")
        .order_by(JobEvent.id.desc())
        .limit(1)
    )
    return session.scalars(q).first()


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


def mark_draining(session: Session, *, name: str) -> None:
    """The worker is shutting down warm: its inventory says so, and the scheduler places nothing
    more on it (its heartbeat stops soon after)."""
    beat = session.get(WorkerBeat, name)
    if beat is not None:
        inventory = dict(beat.devices or {})
        inventory["host"] = {**(inventory.get("host") or {}), "draining": 1}
        beat.devices = inventory
        session.commit()


def live_workers(session: Session, *, within_s: float) -> list[WorkerBeat]:
    cutoff = utcnow() - timedelta(seconds=within_s)
    return [w for w in session.scalars(select(WorkerBeat)).all() if aware(w.last_seen) >= cutoff]


# ---- gangs: one job on several nodes (workers/gang.py) ----------------------------------------
# Node 0 holds the job's lease (claim_job, `Job.owner`); every other node holds its reservation
# row (`Reservation.owner`, its own `lease_until`) for the same attempt. Any node may write the
# job's lines (global rank 0 of torchrun's c10d rendezvous can land on any node), fenced by
# gang_fence. The first node to see the gang broken gives the whole job back (give_back_gang):
# its reservations are deleted, so every other node is fenced off and kills its trainer.


def gang_fence(attempt: Attempt, *, now: datetime) -> Any:
    """The job runs this attempt, and the writer is its owner (node 0) or owns a live reservation
    of the attempt (a reservation made at attempts == n runs attempt n + 1)."""
    member = (
        select(Reservation.id)
        .where(
            Reservation.job_id == attempt.job_id,
            Reservation.attempt == attempt.attempt - 1,
            Reservation.owner == attempt.owner,
            Reservation.lease_until >= now,
        )
        .exists()
    )
    return (
        (Job.id == attempt.job_id)
        & (Job.attempts == attempt.attempt)
        & (Job.status == JobStatus.running)
        & ((Job.owner == attempt.owner) | member)
    )


def _node(attempt: Attempt, node_rank: int) -> Any:
    return (
        (Reservation.job_id == attempt.job_id)
        & (Reservation.node_rank == node_rank)
        & (Reservation.attempt == attempt.attempt - 1)
        & (Reservation.owner == attempt.owner)
    )


def claim_node(
    session: Session, *, job_id: int, node_rank: int, worker: str, owner: str, lease_s: float
) -> Attempt | None:
    """A node's task takes its reservation on this worker (one conditional UPDATE: of two
    deliveries one wins; a retry of this process's own task takes it again). None when the
    scheduler placed no such node here, another process holds it, or the job ended or moved on."""
    now = db_now(session)
    res = session.scalars(
        select(Reservation).where(
            Reservation.job_id == job_id, Reservation.node_rank == node_rank, Reservation.worker == worker
        )
    ).first()
    job = session.get(Job, job_id)
    fits = (
        res is not None
        and job is not None
        and not job.cancel_requested
        and job.status in (JobStatus.queued, JobStatus.running)
        and job.attempts in (res.attempt, res.attempt + 1)
    )
    if not fits:
        session.commit()
        return None
    got = session.execute(
        update(Reservation)
        .where(Reservation.id == res.id, Reservation.owner.is_(None) | (Reservation.owner == owner))  # type: ignore[union-attr]
        .values(owner=owner, claimed_at=now, lease_until=now + timedelta(seconds=lease_s))
    )
    session.commit()
    return Attempt(job_id=job_id, attempt=res.attempt + 1, owner=owner) if got.rowcount == 1 else None  # type: ignore[union-attr]


def unclaim_node(session: Session, *, attempt: Attempt, node_rank: int, reason: str) -> None:
    """A node gives its claim back before the gang started (node 0 never came): the scheduler
    sends the node's task again; the reason goes into the job's log."""
    session.execute(
        update(Reservation)
        .where(_node(attempt, node_rank))
        .values(owner=None, claimed_at=None, lease_until=None)
    )
    session.add(JobEvent(job_id=attempt.job_id, time=time.time(), kind="log", message=reason))
    session.commit()


def set_rdzv_endpoint(session: Session, *, attempt: Attempt, endpoint: str, lease_s: float) -> bool:
    """Node 0 (the job's owner) publishes its rendezvous "host:port" on its reservation and renews
    that reservation's lease. False when fenced off."""
    now = db_now(session)
    res = session.execute(
        update(Reservation)
        .where(_node(attempt, 0), select(Job.id).where(_fence(attempt)).exists())
        .values(rdzv_endpoint=endpoint, claimed_at=now, lease_until=now + timedelta(seconds=lease_s))
    )
    session.commit()
    return res.rowcount == 1


@dataclass(frozen=True, slots=True)
class GangView:
    """What a node of a gang needs to know each poll."""

    intact: bool
    """The job runs this attempt and this node still holds its live reservation."""
    held: bool = False
    """This node's reservation is still there, claimed by it (the job may not run yet)."""
    endpoint: str | None = None
    """Node 0's rendezvous endpoint (None until written)."""
    slots: int = 0
    """Ranks on this node."""
    cancel: bool = False
    preempt: bool = False
    has_result: bool = False
    stopped: bool = False
    """The result says the run stopped before train.steps (a stop asked on some node)."""
    wait_reason: str | None = None
    """The scheduler's reason (a preemption names the job it makes room for)."""


def gang_view(session: Session, *, attempt: Attempt, node_rank: int) -> GangView:
    now = db_now(session)
    job = session.get(Job, attempt.job_id)
    if job is None:
        return GangView(intact=False)
    mine = session.scalars(select(Reservation).where(_node(attempt, node_rank))).first()
    head = session.scalars(
        select(Reservation).where(Reservation.job_id == attempt.job_id, Reservation.node_rank == 0)
    ).first()
    live = mine is not None and mine.lease_until is not None and aware(mine.lease_until) >= now
    running = job.status == JobStatus.running and job.attempts == attempt.attempt
    session.commit()
    return GangView(
        intact=live and running,
        held=mine is not None,
        endpoint=head.rdzv_endpoint
        if head is not None and head.attempt == attempt.attempt - 1 and running
        else None,
        slots=mine.slots if mine is not None else 0,
        cancel=job.cancel_requested,
        preempt=bool(getattr(job, "preempt_requested", False)),
        has_result=job.result is not None,
        stopped=bool((job.result or {}).get("stopped")),
        wait_reason=job.wait_reason,
    )


def _renew_node(
    session: Session,
    *,
    attempt: Attempt,
    node_rank: int,
    lease_s: float,
    now: datetime,
    run_seconds: float | None = None,
) -> bool:
    """Extend this node's reservation lease (node 0: the job's too, recording `run_seconds` when
    given) inside the caller's transaction. False when fenced off."""
    until = now + timedelta(seconds=lease_s)
    if not session.execute(
        update(Reservation)
        .where(_node(attempt, node_rank), Reservation.lease_until >= now)
        .values(lease_until=until)
    ).rowcount:
        return False
    if node_rank != 0:
        return True
    values: dict[str, Any] = {"lease_until": until}
    if run_seconds is not None:
        values["run_seconds"] = run_seconds
    return bool(session.execute(update(Job).where(_fence(attempt)).values(**values)).rowcount)


def renew_node(session: Session, *, attempt: Attempt, node_rank: int, lease_s: float) -> bool:
    """Extend this node's reservation lease (node 0: and the job's). False when fenced off."""
    if not _renew_node(session, attempt=attempt, node_rank=node_rank, lease_s=lease_s, now=db_now(session)):
        session.rollback()
        return False
    session.commit()
    return True


def apply_gang_lines(
    session: Session,
    *,
    attempt: Attempt,
    node_rank: int,
    lines: JobLines,
    lease_s: float,
    now: datetime,
    run_seconds: float | None = None,
) -> Applied | None:
    """apply_lines for one node of a gang, inside the relay's transaction: renews this node's
    reservation lease (node 0: the job's too, and records `run_seconds`, the job's run time over
    all its attempts, as apply_lines does for one node) and applies whatever lines this node's
    trainer wrote (only the node holding global rank 0 writes any), fenced by gang_fence. None
    when fenced off."""
    if not _renew_node(
        session, attempt=attempt, node_rank=node_rank, lease_s=lease_s, now=now, run_seconds=run_seconds
    ):
        return None
    fence = gang_fence(attempt, now=now)
    if lines.empty():
        # no applied_seq round trip: the node with the lines may be writing them right now
        return Applied() if session.scalar(select(Job.id).where(fence)) is not None else None
    return apply_lines(
        session, attempt=attempt, lines=lines, lease_s=lease_s, now=now, fence=fence, renew=False
    )


def gang_restarts_used(session: Session, *, job_id: int) -> int:
    """How many times the job's gang was sent back to the queue after losing a node."""
    rows = session.scalars(
        select(JobEvent.data).where(
            JobEvent.job_id == job_id, JobEvent.kind == "status", JobEvent.message == "queued"
        )
    ).all()
    return sum(1 for d in rows if isinstance(d, dict) and d.get("gang_restart"))


def give_back_gang(
    session: Session,
    *,
    job_id: int,
    attempt: int,
    reason: str,
    restart: bool,
    gang_restarts: int,
    writer: Attempt | None = None,
    fail: bool = False,
) -> str | None:
    """End a gang's attempt as one: every reservation of the job is deleted (so every node is
    fenced off and kills its trainer) and the job goes back to `queued` to be placed again and
    resume from its checkpoint. `restart` (a node was lost or its trainer failed) counts against
    `gang_restarts`; past it, or with `fail`, the job ends `failed` with the reason. A cancel that
    was asked ends it `cancelled`. `writer`: the node doing it (fenced by gang_fence); None: the
    reaper (expire_gangs). Returns the job's new status, or None when the attempt was already over."""
    now = db_now(session)
    fence = (
        gang_fence(writer, now=now)
        if writer is not None
        else (Job.id == job_id) & (Job.attempts == attempt) & (Job.status == JobStatus.running)
    )
    job = session.scalars(select(Job).where(fence)).first()
    if job is None:
        session.rollback()
        return None
    used = gang_restarts_used(session, job_id=job_id)
    # the spec's max_restarts bounds a gang's restarts as a one-node job's; the service's
    # gang_restarts only for a spec stored before the field existed
    own = (job.spec or {}).get("max_restarts")
    limit, named = (gang_restarts, "gang_restarts") if own is None else (int(own), "max_restarts")
    data: dict[str, Any] = {"reason": reason}
    extra: dict[str, Any] = {}
    if job.cancel_requested:
        status, error = JobStatus.cancelled, None
    elif fail or (restart and used >= limit):
        status = JobStatus.failed
        error = reason if fail else f"the gang failed {used + 1} times ({named}={limit}); last: {reason}"
        data = {"error": error}
    else:
        status, error = JobStatus.queued, None
        if restart:
            data.update(gang_restart=used + 1, attempt=attempt)
            extra["restarts"] = used + 1
    terminal = status != JobStatus.queued
    res = session.execute(
        update(Job)
        .where(fence)
        .values(
            status=status,
            error=error,
            owner=None,
            lease_until=None,
            enqueued_at=None,
            finished_at=utcnow() if terminal else None,
            preempt_requested=False,
            **extra,
        )
    )
    if res.rowcount != 1:
        session.rollback()
        return None
    free_job_reservations(session, job_id=job_id)
    session.add(JobEvent(job_id=job_id, time=time.time(), kind="status", message=str(status), data=data))
    session.commit()
    return str(status)


def expire_gangs(session: Session, *, now: datetime, gang_restarts: int) -> tuple[list[Job], list[Job]]:
    """Running multi-node jobs whose lease (node 0) or any claimed node's lease ran out: the gang
    goes back whole (give_back_gang, counted as a restart). Returns (re-queued, cancelled); one
    past its restarts ends failed."""
    lapsed = select(Reservation.job_id).where(
        Reservation.claimed_at.is_not(None), Reservation.lease_until < now
    )
    gangs = session.scalars(
        select(Job).where(
            Job.status == JobStatus.running,
            Job.nnodes > 1,
            Job.lease_until.is_(None) | (Job.lease_until < now) | Job.id.in_(lapsed),
        )
    ).all()
    requeued, cancelled = [], []
    for job in gangs:
        late = session.scalars(
            select(Reservation).where(
                Reservation.job_id == job.id,
                Reservation.claimed_at.is_not(None),
                Reservation.lease_until < now,
            )
        ).all()
        who = ", ".join(f"node {r.node_rank} on {r.worker}" for r in late) or f"node 0 on {job.worker}"
        status = give_back_gang(
            session,
            job_id=job.id,
            attempt=job.attempts,
            reason=f"the lease of {who} (attempt {job.attempts}) ran out",
            restart=True,
            gang_restarts=gang_restarts,
        )
        if status == JobStatus.queued:
            requeued.append(job)
        elif status == JobStatus.cancelled:
            cancelled.append(job)
    return requeued, cancelled
