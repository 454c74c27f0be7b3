"""Gangs: one job on several nodes (workers/gang.py).

Node 0 holds the job's lease (claim_job, `Job.owner`); every other node holds its reservation
row (`Reservation.owner`, its own `lease_until`) for the same attempt. Any node may write the
job's lines (global rank 0 of torchrun's c10d rendezvous can land on any node), fenced by
gang_fence. The first node to see the gang broken gives the whole job back (give_back_gang):
its reservations are deleted, so every other node is fenced off and kills its trainer.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import select, update
from sqlalchemy.orm import Session

from db.connection import rowcount
from db.ingest import Applied, JobLines, apply_lines
from db.jobs import Attempt, attempt_fence, aware, db_now, free_job_reservations
from db.models import Job, JobEvent, JobStatus, Reservation, cap_error, utcnow


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
    if not fits or res is None:  # (fits says res is not None)
        session.commit()
        return None
    got = session.execute(
        update(Reservation)
        .where(Reservation.id == res.id, Reservation.owner.is_(None) | (Reservation.owner == owner))
        .values(owner=owner, claimed_at=now, lease_until=now + timedelta(seconds=lease_s))
    )
    session.commit()
    return Attempt(job_id=job_id, attempt=res.attempt + 1, owner=owner) if rowcount(got) == 1 else None


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
        .where(_node(attempt, 0), select(Job.id).where(attempt_fence(attempt)).exists())
        .values(rdzv_endpoint=endpoint, claimed_at=now, lease_until=now + timedelta(seconds=lease_s))
    )
    session.commit()
    return rowcount(res) == 1


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
    leased = session.execute(
        update(Reservation)
        .where(_node(attempt, node_rank), Reservation.lease_until >= now)
        .values(lease_until=until)
    )
    if not rowcount(leased):
        return False
    if node_rank != 0:
        return True
    values: dict[str, Any] = {"lease_until": until}
    if run_seconds is not None:
        values["run_seconds"] = run_seconds
    return bool(rowcount(session.execute(update(Job).where(attempt_fence(attempt)).values(**values))))


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
        applied_step = session.scalar(select(Job.applied_step).where(fence))
        return Applied(applied_step=applied_step) if applied_step is not None else None
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
        error = cap_error(
            reason if fail else f"the gang failed {used + 1} times ({named}={limit}); last: {reason}"
        )
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
    if rowcount(res) != 1:
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
