"""Data functions for a job's lifecycle: submit, claim, lease, finish, fail, requeue, restart,
release, cancel, and the sweep of lapsed leases.

Each function is one unit of work: it commits what it changed. Routes and workers call these and
map the domain errors to status codes or task outcomes. The trainer's metrics and events are
db/ingest.py's, worker heartbeats db/workers.py's, a job on several nodes db/gangs.py's.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any, TypeVar, overload

from sqlalchemy import delete, exists, func, literal_column, select, text, update
from sqlalchemy.orm import Session

from db.connection import rowcount
from db.models import (
    TERMINAL,
    Job,
    JobEvent,
    JobStatus,
    MetricPoint,
    Reservation,
    User,
    WorkerBeat,
    cap_error,
    utcnow,
)


class NotFound(LookupError):
    pass


Row = TypeVar("Row")


Judge = Callable[[dict[str, Any], list[tuple[int, float]]], tuple[str | None, bool]]
"""(a job's spec, its training loss points in step order) -> (why the run diverged or None,
whether that fails it): jobrules/divergence.py judge, passed in by the workers (db/ imports no
rule of the project's)."""


class Conflict(RuntimeError):
    pass


@overload
def aware(dt: datetime) -> datetime: ...
@overload
def aware(dt: None) -> None: ...
@overload
def aware(dt: datetime | None) -> datetime | None: ...


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
    commit: bool = True,
) -> Job:
    """`actor` (who submitted it) goes into the first status event. `commit` False: the job is
    only flushed, for a caller whose transaction holds more (a trial's job with its trial row)."""
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
    if commit:
        session.commit()
    return job


def get_row(session: Session, model: type[Row], key: int, what: str) -> Row:
    """The `model` row whose primary key is `key`; NotFound ("{what} {key} does not exist") when
    there is none."""
    row = session.get(model, key)
    if row is None:
        raise NotFound(f"{what} {key} does not exist")
    return row


def get_job(session: Session, job_id: int) -> Job:
    return get_row(session, Job, job_id, "job")


def job_status(session: Session, job_id: int) -> str:
    """The job's status alone (NotFound when there is no such job): a stream's periodic look at
    the database needs no more, and loading the whole row decoded its spec each time."""
    status = session.scalar(select(Job.status).where(Job.id == job_id))
    if status is None:
        raise NotFound(f"job {job_id} does not exist")
    return str(status)


def listing_filters(
    model: Any,
    *,
    owner_id: int | None,
    status: str | None,
    owner: str | None,
    name: str | None,
    sqlite: bool = False,
) -> list[Any]:
    """The WHERE terms of a listing of `model` (jobs, selection batches: both have owner_id,
    status and name): `owner_id` one user's rows (a non-admin's view), `status` one status,
    `owner` a user by name, `name` a substring in any case. `sqlite`: the session's database is
    SQLite."""
    where = []
    if owner_id is not None:
        where.append(model.owner_id == owner_id)
    if status:
        where.append(model.status == status)
    if owner:
        where.append(model.owner_id == select(User.id).where(User.name == owner).scalar_subquery())
    if name:
        # SQLite's LIKE ignores ASCII case already, as its lower() folds ASCII only: the same
        # matches without a lower() of every row, which made a search 4x slower (bench/scale.py)
        like = model.name.contains if sqlite else model.name.icontains
        where.append(like(name, autoescape=True))
    return where


RARE_MATCHES = 5000
"""A name search with fewer matches than this pages through ix_jobs_listing (list_jobs)."""


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
    sqlite = session.get_bind().dialect.name == "sqlite"
    where = listing_filters(Job, owner_id=owner_id, status=status, owner=owner, name=name, sqlite=sqlite)
    if kind:
        where.append(Job.kind == kind)
    # the count reads ix_jobs_listing alone (migration 0015), not every job's row
    total = session.scalar(select(func.count(Job.id)).where(*where)) or 0
    if offset >= total:
        return [], total
    newest = select(Job).where(*where).order_by(Job.id.desc())
    if name and sqlite and total < RARE_MATCHES:
        # few jobs match: SQLite would walk the table in id order (every wide row, specs and all,
        # when the matches are old); ordered by an expression instead of the rowid, it takes the
        # page's ids from the narrow index, then reads those rows only
        ids = session.scalars(
            select(Job.id)
            .where(*where)
            .order_by(literal_column("+jobs.id").desc())
            .limit(limit)
            .offset(offset)
        ).all()
        newest = select(Job).where(Job.id.in_(ids)).order_by(Job.id.desc())
    else:
        newest = newest.limit(limit).offset(offset)
    return session.scalars(newest).all(), total


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
    now: datetime = session.scalar(text("SELECT clock_timestamp()"))
    return aware(now)


def attempt_fence(attempt: Attempt) -> Any:
    """The job runs this attempt of this owner: every write of an attempt is fenced by it."""
    return (Job.id == attempt.job_id) & (Job.attempts == attempt.attempt) & (Job.owner == attempt.owner)


def set_run_note(session: Session, *, attempts: list[Attempt], note: str | None) -> None:
    """What a running attempt waits on before it trains (`preparing environment`), shown as the
    job's wait_reason; None clears it. Fenced: a stale attempt changes nothing."""
    for attempt in attempts:
        session.execute(update(Job).where(attempt_fence(attempt)).values(wait_reason=note))


def _lapsed(now: datetime) -> Any:
    return Job.lease_until.is_(None) | (Job.lease_until < now)


def _claimable(owner: str) -> Any:
    """Queued, or running under the lease this very process holds (a retry of its own task
    re-claims instead of skipping). A lease that ran out is taken back first (claim_job)."""
    return (Job.status == JobStatus.queued) | ((Job.status == JobStatus.running) & (Job.owner == owner))


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
    max_restarts: Callable[[dict[str, Any]], int] | None = None,
) -> Attempt | None:
    """Take the lease of job `job_id` for `owner` (one worker process start), atomically: one
    conditional UPDATE, so of many racing deliveries exactly one wins. None when the job is taken
    (a live lease), ended, cancelled, or of another kind (a trial runs only inside its batch).
    `reserved`: only when the scheduler reserved node 0 of the job on `worker` (a task for a job
    placed elsewhere is skipped); the reservation records the claim. `now`: the database time
    to start it at (the trials of one group share their claim's). A job running under a lease
    that ran out (a redelivered message after its process died) is first taken back as the
    reconciler does (take_back: its cause said, the lost attempt counted against
    `max_restarts(spec)` as in expire_leases), in this same transaction, so whichever of the
    two gets there first, the lost attempt is explained and counted once."""
    if now is None:
        now = db_now(session)
    stale = session.scalars(
        select(Job).where(
            Job.id == job_id,
            Job.kind == kind,
            Job.status == JobStatus.running,
            _lapsed(now),
            Job.owner.is_(None) | (Job.owner != owner),
        )
    ).first()
    claimable = _claimable(owner)
    if stale is not None and (stale.nnodes or 1) > 1:
        # a gang is taken back whole, every node's reservation (db/gangs.py expire_gangs); its
        # node 0 re-claims a lapsed lease as it is
        claimable = claimable | ((Job.status == JobStatus.running) & _lapsed(now))
    elif stale is not None:
        take_back(session, stale, now=now, max_restarts=max_restarts, keep_slots=reserved)
    where = [Job.id == job_id, Job.kind == kind, Job.cancel_requested.is_(False), claimable]
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
    return (aware(job.lease_until) - db_now(session)).total_seconds()


def renew_lease(session: Session, *, attempt: Attempt, lease_s: float) -> bool:
    """Extend the lease; False when the attempt was fenced off."""
    now = db_now(session)
    res = session.execute(
        update(Job).where(attempt_fence(attempt)).values(lease_until=now + timedelta(seconds=lease_s))
    )
    session.commit()
    return rowcount(res) == 1


def loss_points(session: Session, *, job_id: int) -> list[tuple[int, float]]:
    """(step, value) of the job's training loss, every attempt's, in step order."""
    q = (
        select(MetricPoint.step, MetricPoint.value)
        .where(MetricPoint.job_id == job_id, MetricPoint.name == "loss")
        .order_by(MetricPoint.step)
    )
    return [(int(st), float(v)) for st, v in session.execute(q).all()]


def judge_divergence(session: Session, *, job_id: int, judge: Judge) -> tuple[str | None, bool]:
    """`judge` applied to the job's spec and its whole loss series (all its attempts' points, so a
    resumed job is judged on its run)."""
    spec = session.scalar(select(Job.spec).where(Job.id == job_id)) or {}
    return judge(spec, loss_points(session, job_id=job_id))


def finish_job(
    session: Session,
    *,
    attempt: Attempt,
    status: JobStatus,
    error: str | None = None,
    result: dict[str, Any] | None = None,
    judge: Judge | None = None,
) -> int | None:
    """running -> terminal for this attempt only, with its status event, in one transaction.
    `result` None keeps the one already stored when it arrived. Returns the event's id, or None
    when the attempt was fenced off (then nothing changes). A long `error` is stored cut to
    its head and tail (db/models.py cap_error), in the row and in the event. `judge`: a run
    that succeeded is judged for divergence; a diverged one is flagged (`divergence`), or ends
    `failed` with the divergence as its error when its spec asks."""
    assert status in TERMINAL, status
    values: dict[str, Any] = {}
    if judge is not None and status == JobStatus.succeeded:
        why, fail = judge_divergence(session, job_id=attempt.job_id, judge=judge)
        values["divergence"] = why
        if why is not None and fail:
            status, error = JobStatus.failed, f"{why}; train.fail_on_divergence is set"
    error = cap_error(error)
    values |= {
        "status": status,
        "error": error,
        "finished_at": utcnow(),
        "owner": None,
        "lease_until": None,
    }
    if result is not None:
        values["result"] = result
    res = session.execute(update(Job).where(attempt_fence(attempt)).values(**values, preempt_requested=False))
    if rowcount(res) != 1:
        session.rollback()
        return None
    free_job_reservations(session, job_id=attempt.job_id)
    data: dict[str, Any] = {"error": error}
    if values.get("divergence"):
        data["divergence"] = values["divergence"]
    ev = JobEvent(job_id=attempt.job_id, time=time.time(), kind="status", message=str(status), data=data)
    session.add(ev)
    session.commit()
    return ev.id


def release_job(session: Session, *, attempt: Attempt, reason: str) -> bool:
    """This attempt gives the job back (warm shutdown): running -> queued, to be resumed from its
    checkpoint by whoever claims it next. False when it was fenced off."""
    res = session.execute(
        update(Job)
        .where(attempt_fence(attempt), Job.status == JobStatus.running)
        .values(
            status=JobStatus.queued, owner=None, lease_until=None, enqueued_at=None, preempt_requested=False
        )
    )
    if rowcount(res) != 1:
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
    session: Session, job: Job, *, reason: str, max_restarts: int
) -> tuple[dict[str, Any], str, dict[str, Any]]:
    """(column values, status, event data) of a job whose attempt failed for the infrastructure:
    back to the queue with its restart counted, or failed with every attempt's reason once
    max_restarts is used up."""
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
    error = cap_error(
        restarts_spent_error(
            session, job_id=job.id, attempt=job.attempts, reason=reason, max_restarts=max_restarts
        )
    )
    values.update(status=JobStatus.failed, error=error, finished_at=utcnow())
    return values, JobStatus.failed, {"error": error}


def restart_job(session: Session, *, attempt: Attempt, reason: str, max_restarts: int) -> str | None:
    """This attempt failed for the infrastructure (a rank killed by a signal): running -> queued,
    to resume from its checkpoint, counted in `restarts`; once `max_restarts` are used, running ->
    failed with every attempt's reason. Returns the new status, or None when it was fenced off."""
    job = session.scalars(select(Job).where(attempt_fence(attempt), Job.status == JobStatus.running)).first()
    if job is None:
        session.rollback()
        return None
    values, status, data = _restart_values(session, job, reason=reason, max_restarts=max_restarts)
    res = session.execute(
        update(Job).where(attempt_fence(attempt), Job.status == JobStatus.running).values(**values)
    )
    if rowcount(res) != 1:
        session.rollback()
        return None
    free_job_reservations(session, job_id=attempt.job_id)
    session.add(JobEvent(job_id=job.id, time=time.time(), kind="status", message=str(status), data=data))
    session.commit()
    return str(status)


LOST_EVENT = "lost"
"""The kind of the event a worker records when it saw the process running an attempt die (or
its data disk fill): record_lost. It names the cause whoever takes the lease back gives."""


def record_lost(session: Session, *, worker: str | None, owner_prefix: str, cause: str) -> list[int]:
    """The worker saw the process holding these leases end: every job (or trial) running on
    `worker` (None: any) under an owner that starts with `owner_prefix` (a process start's id,
    workers/attempt.py owner_id, or its host:pid: part) gets `cause` recorded beside its
    attempt, for take_back to give as the reason. Returns those jobs' ids."""
    where = [Job.status == JobStatus.running, Job.owner.startswith(owner_prefix, autoescape=True)]
    if worker is not None:
        where.append(Job.worker == worker)
    rows = session.execute(select(Job.id, Job.attempts, Job.owner).where(*where)).all()
    for job_id, attempt, owner in rows:
        data = {"attempt": attempt, "owner": owner}
        said = session.scalars(
            select(JobEvent.data).where(JobEvent.job_id == job_id, JobEvent.kind == LOST_EVENT)
        ).all()
        if data in said:  # seen twice (the pool watch, then billiard's error): recorded once
            continue
        session.add(JobEvent(job_id=job_id, time=time.time(), kind=LOST_EVENT, message=cause, data=data))
    session.commit()
    return [r[0] for r in rows]


def lost_reason(session: Session, *, job: Job, now: datetime) -> str:
    """Why the attempt holding `job`'s lease (which ran out by `now`) stopped renewing it: the
    cause its worker recorded (record_lost), else what the worker's heartbeat says: a worker (of
    that name) that beat after the lease ran out lives, only the process running the attempt is
    gone."""
    recorded = session.scalars(
        select(JobEvent)
        .where(JobEvent.job_id == job.id, JobEvent.kind == LOST_EVENT)
        .order_by(JobEvent.id.desc())
        .limit(8)
    ).all()
    for ev in recorded:
        data = ev.data or {}
        if data.get("attempt") == job.attempts and data.get("owner") == job.owner:
            return f"{job.worker}: {ev.message}"
    beat = session.get(WorkerBeat, job.worker) if job.worker else None
    lapsed = aware(job.lease_until)
    if beat is not None and lapsed is not None and aware(beat.last_seen) > lapsed:
        ago = (now - lapsed).total_seconds()
        return (
            f"{job.worker}: the process running it was lost (its lease ran out {ago:.0f} s ago while "
            "the worker, or a restart of it, kept sending heartbeats)"
        )
    if beat is None:
        return f"{job.worker}: the worker was lost (no heartbeat on record)"
    silent = (now - aware(beat.last_seen)).total_seconds()
    return f"{job.worker}: the worker was lost (no heartbeat for {silent:.0f} s)"


def take_back(
    session: Session,
    job: Job,
    *,
    now: datetime,
    max_restarts: Callable[[dict[str, Any]], int] | None,
    keep_slots: bool = False,
) -> str | None:
    """`job` runs under a lease that ran out by `now`: a cancel that was asked ends it
    `cancelled`, else it goes back to `queued` with its cause (lost_reason), the lost attempt
    counted against `max_restarts(spec)` for a job (not a trial: its selection group is retried
    as one; None counts nothing), and past it `failed` with every attempt's reason. One
    conditional UPDATE on the attempt: of the reconciler and a claim racing, one takes it back,
    once. `keep_slots`: a re-queued job keeps its reservation (a claim follows in the same
    transaction). Returns the new status, or None when it was already taken back; the caller
    commits."""
    cancel = job.cancel_requested
    why = lost_reason(session, job=job, now=now)
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
        values, _, data = _restart_values(session, job, reason=why, max_restarts=limit)
    res = session.execute(
        update(Job)
        .where(Job.id == job.id, Job.attempts == job.attempts, Job.status == JobStatus.running, _lapsed(now))
        .values(**values)
        .execution_options(synchronize_session="fetch")
    )
    if rowcount(res) != 1:
        return None
    status = str(values["status"])
    if not (keep_slots and status == JobStatus.queued):
        free_job_reservations(session, job_id=job.id)
    session.add(JobEvent(job_id=job.id, time=time.time(), kind="status", message=status, data=data))
    return status


def expire_leases(
    session: Session,
    *,
    now: datetime | None = None,
    max_restarts: Callable[[dict[str, Any]], int] | None = None,
) -> tuple[list[Job], list[Job]]:
    """Running jobs (and trials) whose lease ran out by database time `now` (the database's clock
    when None): the owner is gone or cut off. Each is taken back (take_back: a cancel that was
    asked ends it `cancelled`; the rest go back to `queued` with the cause of the loss and no
    message on record, for the scheduler to place again). A multi-node job goes back whole when
    its lease or any node's ran out: the reconciler gives those back first (db/gangs.py
    expire_gangs, at the same `now`). `max_restarts(spec)`: a job (not a trial) counts the lost
    attempt against it, and past it ends `failed` with every attempt's reason; None counts
    nothing. Returns (re-queued, cancelled)."""
    if now is None:
        now = db_now(session)
    requeued: list[Job] = []
    cancelled: list[Job] = []
    gone = session.scalars(select(Job).where(Job.status == JobStatus.running, _lapsed(now))).all()
    for job in gone:
        status = take_back(session, job, now=now, max_restarts=max_restarts)
        if status == JobStatus.queued:
            requeued.append(job)
        elif status == JobStatus.cancelled:
            cancelled.append(job)
    session.commit()
    return requeued, cancelled


def _operator_sets(
    session: Session, *, job: Job, values: dict[str, Any], data: dict[str, Any], actor: str | None
) -> Job:
    """An operator's change of a job's status (fail_job, requeue_job), whatever its attempt: the
    row, its slots back to the pool, the status event naming `actor`, in one transaction."""
    session.execute(update(Job).where(Job.id == job.id).values(**values))
    free_job_reservations(session, job_id=job.id)
    by = {"by": actor} if actor else {}
    event = JobEvent(
        job_id=job.id, time=time.time(), kind="status", message=str(values["status"]), data={**data, **by}
    )
    session.add(event)
    session.commit()
    session.refresh(job)
    return job


def fail_job(session: Session, *, job_id: int, reason: str, actor: str | None = None) -> Job:
    """An operator ends a job `failed` whatever its state; a running attempt is fenced off (its
    worker notices at its next batch and kills the trainer)."""
    job = get_job(session, job_id)
    if job.status in TERMINAL:
        raise Conflict(f"job {job_id} is already {job.status}")
    reason = cap_error(reason) or ""
    values = {
        "status": JobStatus.failed,
        "error": reason,
        "finished_at": utcnow(),
        "owner": None,
        "lease_until": None,
    }
    return _operator_sets(session, job=job, values=values, data={"error": reason}, actor=actor)


def requeue_job(session: Session, *, job_id: int, reason: str, actor: str | None = None) -> Job:
    """An operator puts a job back in the queue: a running one (its attempt fenced off), or an
    ended one to run again (resuming from its checkpoint). The caller sends the message."""
    job = get_job(session, job_id)
    if job.status == JobStatus.queued:
        raise Conflict(f"job {job_id} is already queued")
    values = {
        "status": JobStatus.queued,
        "owner": None,
        "lease_until": None,
        "cancel_requested": False,
        "error": None,
        "finished_at": None,
        "enqueued_at": utcnow(),
        "preempt_requested": False,
    }
    return _operator_sets(session, job=job, values=values, data={"reason": reason}, actor=actor)


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
    if rowcount(res) == 1:
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
