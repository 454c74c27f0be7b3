"""The queue as the scheduler sees it, for REST: positions, reasons and reservations.

Positions come from the scheduler's own ordering code (core/scheduler.py order_queue) run on the
database's current state, so GET /api/queue and the job views agree with the next tick."""

from __future__ import annotations

import time

from fastapi import Request
from sqlalchemy.orm import Session

from api.schemas import JobPublic, QueueEntry, ReservationPublic
from core.scheduler import Want, queue_positions
from core.settings import Settings
from db.models import Job
from db.scheduling import reservations_of

_CACHE: dict[str, tuple[float, list[Want]]] = {}
CACHE_S = 0.5
"""Positions are recomputed at most this often per database (a dashboard polling the job list
must not order the whole queue on every request); they move only as fast as the scheduler ticks."""


def wake_scheduler(request: Request) -> None:
    """A job was queued: the API's embedded scheduler (if this process runs one) ticks now, and
    the next position asked for is computed afresh."""
    _CACHE.clear()
    sched = getattr(request.app.state, "scheduler", None)
    if sched is not None:
        sched.wake()


def positions(session: Session, settings: Settings) -> tuple[list[Want], dict[int, int]]:
    hit = _CACHE.get(settings.database_url)
    if hit is not None and time.monotonic() - hit[0] < CACHE_S:
        order = hit[1]
    else:
        order = queue_positions(session, settings)
        _CACHE[settings.database_url] = (time.monotonic(), order)
    # a selection group's position is its every trial's
    return order, {j: i + 1 for i, w in enumerate(order) for j in (w.members or (w.id,))}


def with_placement(session: Session, settings: Settings, jobs: list[Job], out: list[JobPublic]) -> None:
    """Fill queue_position of the queued jobs and the reservation of each job, in place."""
    if any(j.status == "queued" for j in jobs):
        _, where = positions(session, settings)
        for p in out:
            p.queue_position = where.get(p.id) if p.status == "queued" else None
    held = reservations_of(session, [j.id for j in jobs if j.status in ("queued", "running")])
    for p in out:
        p.reservation = [
            ReservationPublic(
                worker=r.worker,
                node_rank=r.node_rank,
                nnodes=r.nnodes,
                slots=r.slots,
                gpus=r.gpus,
                ram_bytes=r.ram_bytes,
                claimed=r.claimed_at is not None,
            )
            for r in held.get(p.id, [])
        ]


def queue_entries(
    session: Session, settings: Settings, *, owner_id: int | None
) -> tuple[list[QueueEntry], int]:
    """Every queued job and selection group in order (`owner_id` None: an admin's view), or only
    that user's."""
    order, _ = positions(session, settings)
    mine = [(i + 1, w) for i, w in enumerate(order) if owner_id is None or w.user == owner_id]
    jobs = {j.id: j for j in session.query(Job).filter(Job.id.in_([w.id for _, w in mine]))} if mine else {}
    now = time.time()
    items = [
        QueueEntry(
            position=pos,
            job_id=w.id,
            name=jobs[w.id].name,
            owner=jobs[w.id].user.name if jobs[w.id].user else None,
            priority=w.priority,
            effective_priority=w.eff,
            world_size=w.ranks,
            waited_s=round(max(0.0, now - w.created), 3),
            wait_reason=jobs[w.id].wait_reason,
            selection_id=w.selection,
            trial_ids=list(w.trials),
        )
        for pos, w in mine
        if w.id in jobs
    ]
    return items, len(order)
