"""The queue as the scheduler sees it, for REST: positions, reasons and reservations.

Positions come from the scheduler's own order (core/scheduler.py order_queue's, walked by
core/queue_cache.py lazy_order) on the database's current state, so GET /api/queue and the job
views agree with the next tick. Like the scheduler, the API keeps the queued jobs between orderings
(a QueueCache per database): an ordering reads again only the jobs that joined, left or came back
since the last one, not every queued row, and merges the kept per-priority lanes instead of sorting
the whole queue (with 600 jobs queued at 20 submits a second, every job listing that showed a new
job ordered the whole queue in its request's thread)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable

from fastapi import Request
from sqlalchemy.orm import Session

from api.convert import from_row
from api.schemas import JobPublic, QueueEntry, ReservationPublic
from core.queue_cache import QueueCache, lazy_order
from core.scheduler import Want, _Needs, read_state
from core.settings import Settings
from db.connection import session_for
from db.jobs import aware
from db.models import Job
from db.queue_view import queued_priorities
from db.scheduling import reservations_of

_CACHE: dict[str, tuple[float, list[Want], dict[int, int], float]] = {}
"""Per database: (monotonic time computed, order, positions, unix time computed)."""
CACHE_S = 0.5
"""Positions are recomputed at most this often per database (a dashboard polling the job list
must not order the whole queue on every request); they move only as fast as the scheduler ticks."""
STALE_S = 5.0
"""The oldest positions a job listing or a job's page is answered with while fresher ones are
worked out in the background: ordering a queue of 10,000 jobs takes 100-150 ms, which every
page of the jobs list with a queued job on it paid each CACHE_S (bench/scale.py: its p95)."""
_DIRTY: set[str] = set()
_REFRESHING: set[str] = set()
_LOCK = threading.Lock()


def wake_scheduler(request: Request) -> None:
    """A job was queued: the API's embedded scheduler (if this process runs one) ticks now, and
    the next position asked for is computed afresh (by a job listing: in the background, unless
    it shows a job the positions it has do not hold)."""
    _DIRTY.update(_CACHE)
    sched = getattr(request.app.state, "scheduler", None)
    if sched is not None:
        sched.wake()


class _Kept:
    """One database's queued jobs between orderings (what the scheduler keeps, core/queue_cache.py)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.cache = QueueCache()
        self.needs = _Needs()


_KEPT: dict[str, _Kept] = {}


def queue_positions(session: Session, settings: Settings) -> list[Want]:
    """The queued jobs and selection groups in the scheduler's order, as core/scheduler.py
    queue_positions orders a full read of them. The kept jobs are brought up to the database
    first: the ones that joined or came back are read, the ones that left dropped (their versions,
    as the scheduler's tick reads them), and everything is read again when a priority changed in
    place (no version shows that) or the cache's FULL_S has passed."""
    kept = _KEPT.setdefault(settings.database_url, _Kept())
    with kept.lock:  # one ordering at a time: lazy_order sets each kept want's effective priority
        cache = kept.cache
        cache.refresh(session, kept.needs)
        held = cache.wants.values()
        if queued_priorities(session) != (
            sum(w.priority for w in held),
            sum(w.priority * w.id for w in held),
        ):
            cache.refresh(session, kept.needs, full=True)
        # the selection groups (never kept: a few rows), the running slots and recent usage
        st = read_state(session, settings, kept.needs, jobs=False)
        groups = sorted(st.wants, key=lambda w: (w.created, w.id))
        lanes: list[list[Want]] = [lane for _, lane in cache.lanes.values()]
        lanes += [[w for w in groups if w.priority == p] for p in sorted({w.priority for w in groups})]
        return list(
            lazy_order(
                lanes, now=st.now, aging_s=settings.aging_s, running_slots=st.running_slots, recent=st.recent
            )
        )


def _compute(session: Session, settings: Settings) -> tuple[list[Want], dict[int, int]]:
    started = time.time()
    order = queue_positions(session, settings)
    # a selection group's position is its every trial's
    where = {j: i + 1 for i, w in enumerate(order) for j in (w.members or (w.id,))}
    with _LOCK:
        _CACHE[settings.database_url] = (time.monotonic(), order, where, started)
    return order, where


def _refresh(settings: Settings) -> None:
    try:
        with session_for(settings.database_url) as s:
            _compute(s, settings)
    finally:
        with _LOCK:
            _REFRESHING.discard(settings.database_url)


def positions(
    session: Session,
    settings: Settings,
    *,
    stale_ok: bool = False,
    need: Iterable[tuple[int, float]] = (),
) -> tuple[list[Want], dict[int, int]]:
    """The queue in the scheduler's order and each queued job's 1-based position. `stale_ok`:
    positions up to STALE_S old will do while fresher ones are worked out in a thread of their
    own, unless a job of `need` ((id, unix time created): the queued jobs the caller shows) is
    newer than them and not in them (just submitted); else positions older than CACHE_S (or from
    before a submit) are worked out now. A queued job a reservation holds has no position."""
    url = settings.database_url
    with _LOCK:
        hit = _CACHE.get(url)
        age = time.monotonic() - hit[0] if hit is not None else float("inf")
        dirty = url in _DIRTY
        _DIRTY.discard(url)
        due = dirty or age >= CACHE_S
        newer = hit is not None and any(j not in hit[2] and at >= hit[3] - 1.0 for j, at in need)
        if hit is not None and stale_ok and age < STALE_S and not newer:
            if due and url not in _REFRESHING:
                _REFRESHING.add(url)
                threading.Thread(
                    target=_refresh, args=(settings,), daemon=True, name="queue-positions"
                ).start()
            return hit[1], hit[2]
        if hit is not None and not due and not newer:
            return hit[1], hit[2]
    return _compute(session, settings)


def with_placement(session: Session, settings: Settings, jobs: list[Job], out: list[JobPublic]) -> None:
    """Fill queue_position of the queued jobs and the reservation of each job, in place."""
    if queued := [(j.id, aware(j.created_at).timestamp()) for j in jobs if j.status == "queued"]:
        _, where = positions(session, settings, stale_ok=True, need=queued)
        for p in out:
            p.queue_position = where.get(p.id) if p.status == "queued" else None
    held = reservations_of(session, [j.id for j in jobs if j.status in ("queued", "running")])
    for p in out:
        p.reservation = [
            from_row(ReservationPublic, r, claimed=r.claimed_at is not None) for r in held.get(p.id, [])
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
