"""The scheduler's database side: its lock row, what it reads each tick (queued jobs and selection
groups, worker inventory, reservations, recent usage), and the one conditional transaction that
reserves a job's nodes or a group's worker.

Nothing is sent from here (db/ imports SQLAlchemy only); core/scheduler.py decides and sends.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import (
    BigInteger,
    Integer,
    String,
    Text,
    bindparam,
    cast,
    delete,
    func,
    insert,
    select,
    type_coerce,
    union_all,
    update,
)
from sqlalchemy.dialects.postgresql import ARRAY
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session
from sqlalchemy.sql.elements import BindParameter

from db.connection import AnyRow, rowcount
from db.jobs import aware, db_now
from db.models import Job, JobStatus, Reservation, SchedulerLock, Selection, Trial, User, WorkerBeat, utcnow
from db.quotas import job_gpus as spec_gpus
from db.quotas import quota_reason
from jobrules.spec import SelectionCreate, stored_field

LOCK = "scheduler"


def _rows(session: Session, stmt: Any) -> Sequence[AnyRow]:
    """Run a read through the session's connection: plain rows, without the ORM's per-row work
    (a tick reads every queued job; through Session.execute that cost 5 ms of 1,000 rows).

    The tick's writes go through the connection too (`conn = session.connection()`): the
    scheduler's session holds no ORM objects, and an ORM UPDATE that cannot evaluate its WHERE
    in Python fetches every matched id back to keep the identity map in step (986 ids for a
    wait-reason rewrite)."""
    return session.connection().execute(stmt).all()


# ---- the lock: one active scheduler ---------------------------------------------------------


def acquire_lock(
    session: Session, *, holder: str, lease_s: float, name: str = LOCK, now: datetime | None = None
) -> bool:
    """Take or renew the lock row for `holder`: one conditional UPDATE (free, expired by database
    time, or already ours), so of several schedulers exactly one holds it at a time. `now`: the
    database time when the caller has just read it."""
    if now is None:
        now = db_now(session)
    free = (
        SchedulerLock.holder.is_(None) | (SchedulerLock.lease_until < now) | (SchedulerLock.holder == holder)
    )
    res = session.connection().execute(
        update(SchedulerLock)
        .where(SchedulerLock.name == name, free)
        .values(holder=holder, lease_until=now + timedelta(seconds=lease_s))
    )
    if rowcount(res) == 1:
        session.commit()
        return True
    exists = session.scalar(select(SchedulerLock.name).where(SchedulerLock.name == name))
    session.rollback()
    if exists is not None:
        return False
    try:
        session.add(SchedulerLock(name=name, holder=holder, lease_until=now + timedelta(seconds=lease_s)))
        session.commit()
        return True
    except IntegrityError:  # another scheduler made the row first
        session.rollback()
        return False


def release_lock(session: Session, *, holder: str, name: str = LOCK) -> None:
    session.execute(
        update(SchedulerLock)
        .where(SchedulerLock.name == name, SchedulerLock.holder == holder)
        .values(holder=None, lease_until=None)
    )
    session.commit()


# ---- what a tick reads --------------------------------------------------------------------------


# the statements a tick runs every time are built once (building one costs about as much as
# running it on this scale)
_QUEUED_WHERE = (
    (Job.status == JobStatus.queued)
    & (Job.kind == "job")
    & Job.cancel_requested.is_(False)
    & Job.id.not_in(select(Reservation.job_id))
)
_QUEUED = select(Job.id, Job.owner_id, Job.priority, Job.world_size, Job.queue, Job.wait_reason).where(
    _QUEUED_WHERE
)


def queued_jobs(session: Session, ids: Sequence[int] | None = None) -> Sequence[AnyRow]:
    """Queued jobs with no reservation yet (trials run inside their batch's task, not here):
    rows of (id, owner_id, priority, world_size, queue, wait_reason), by name or position.
    `ids`: only those of these jobs (read in chunks)."""
    if ids is None:
        return _rows(session, _QUEUED)
    out: list[AnyRow] = []
    for i in range(0, len(ids), 500):
        out += _rows(session, _QUEUED.where(Job.id.in_(list(ids[i : i + 500]))))
    return out


# a queued job's version: what changes whenever it leaves the queue and comes back (a reservation
# sets enqueued_at, a requeue clears it, a claim counts an attempt); read from ix_jobs_queued alone
_QUEUED_VERSIONS = select(
    Job.id, func.coalesce(cast(Job.enqueued_at, Text), "-") + "/" + cast(Job.attempts, Text)
).where(_QUEUED_WHERE)


def _raw(session: Session, stmt: Any) -> list[Any]:
    """Rows of a statement on the queue's index, through the driver's cursor in the session's
    transaction (12,000 rows through SQLAlchemy's result took longer than the rest of a tick,
    bench/scale.py). SQLite is told to read ix_jobs_queued: its planner prefers ix_jobs_listing,
    which is not partial and so holds neither the versions nor the queue alone."""
    conn = session.connection()
    key = (id(stmt), conn.dialect.name)
    sql = _RAW_SQL.get(key)
    if sql is None:
        sql = str(stmt.compile(dialect=conn.dialect, compile_kwargs={"literal_binds": True}))
        if conn.dialect.name == "sqlite":
            sql = sql.replace("FROM jobs ", "FROM jobs INDEXED BY ix_jobs_queued ", 1)
        _RAW_SQL[key] = sql
    cur = conn.connection.driver_connection.cursor()  # type: ignore[union-attr]
    try:
        cur.execute(sql)
        return list(cur.fetchall())
    finally:
        cur.close()


_RAW_SQL: dict[tuple[int, str], str] = {}


def queued_versions(session: Session) -> dict[int, str]:
    """Per queued job that `queued_jobs` would read: its version (the incremental scheduler,
    core/queue_cache.py, reads again only the jobs whose version it does not hold)."""
    return dict(_raw(session, _QUEUED_VERSIONS))


_FINGERPRINT = select(
    func.count(),
    func.coalesce(func.sum(Job.id), 0),
    # 64-bit: an id past 46,340 has a square past a 32-bit integer (PostgreSQL's id * id failed)
    func.coalesce(func.sum(cast(Job.id, BigInteger) * cast(Job.id, BigInteger)), 0),
    func.coalesce(func.sum(Job.attempts), 0),
).where(_QUEUED_WHERE)


def queued_fingerprint(session: Session) -> tuple[int, int, int, int]:
    """(count, sum of ids, sum of their squares, sum of attempts) of the jobs `queued_versions`
    reads, from the index alone (about 1 ms for 12,000 where their versions take 6-16): a job that
    leaves the queue, or comes back to it claimed once more, changes it; the squares tell apart two
    sets of ids with one sum (jobs 100 and 104 left as 101 and 103 came back). What still collides
    is read in full within the cache's FULL_S."""
    n, ids, squares, attempts = _raw(session, _FINGERPRINT)[0]
    return int(n), int(ids), int(squares), int(attempts)


@dataclass(slots=True)
class QueuedGroup:
    """One group of a batch's queued trials that no reservation holds yet: up to the batch's
    `group_size` trials in index order, run by one task on one worker over `devices` devices.
    Its first trial's job stands for it (reservation, reason, queue position)."""

    selection_id: int
    job_ids: list[int]
    trial_ids: list[int]
    owner_id: int | None
    priority: int
    queue: str
    devices: int
    wait_reason: str | None


MIXED = "\0"
"""A group whose trials carry different wait reasons (never a reason itself)."""


_QUEUED_TRIALS = (
    select(
        Trial.selection_id,
        Trial.id,
        Job.id,
        Job.owner_id,
        Job.priority,
        Job.queue,
        Job.wait_reason,
    )
    .join(Job, Job.id == Trial.job_id)
    .join(Selection, Selection.id == Trial.selection_id)
    .where(
        Job.status == JobStatus.queued,
        Job.kind == "trial",
        Job.cancel_requested.is_(False),
        Selection.cancel_requested.is_(False),
    )
    .order_by(Trial.selection_id, Trial.index)
)
_REQUESTS = select(Selection.id, cast(Selection.request, Text)).where(
    Selection.id.in_(bindparam("ids", expanding=True))
)


class GroupShapes:
    """Per batch: (group_size, devices) from its request, kept between the scheduler's ticks by
    the request's text. A tick reads the text of each batch with queued trials (one row a batch)
    and decodes it only when it differs from what is kept: the request came back with every
    queued trial's row, decoded once a trial (a 10,000-trial batch: 10,000 decodes a tick)."""

    def __init__(self) -> None:
        self.kept: dict[int, tuple[str | None, int, int]] = {}

    def read(self, session: Session, ids: Iterable[int]) -> dict[int, tuple[int, int]]:
        """(group_size, devices) of batches `ids`; batches not asked for are forgotten."""
        kept: dict[int, tuple[str | None, int, int]] = {}
        wanted = sorted(set(ids))
        for sid, text in session.connection().execute(_REQUESTS, {"ids": wanted}) if wanted else ():
            k = self.kept.get(sid)
            if k is None or k[0] != text:
                request = json.loads(text) if text is not None else None
                size = stored_field(SelectionCreate, request or {}, "group_size")
                k = (text, max(int(size), 1), batch_devices(request))
            kept[sid] = k
        self.kept = kept
        return {sid: (size, devices) for sid, (_, size, devices) in kept.items()}


def queued_groups(
    session: Session, *, held: Iterable[HeldRow] | None = None, shapes: GroupShapes | None = None
) -> list[QueuedGroup]:
    """The queued trials of every batch not cancelled, less those a group reservation already
    holds, cut into groups of the batch's `group_size` in index order. `held`: the reservations
    the caller has just read (`reservations`), so they are not read again; `shapes`: the batches'
    group sizes and devices as the caller keeps them between calls."""
    taken: set[int] = set()
    if held is None:
        for ids in session.scalars(select(Reservation.trial_ids).where(Reservation.trial_ids.is_not(None))):
            taken.update(ids or [])
    else:
        for h in held:
            taken.update(h.trial_ids or [])
    rows = _rows(session, _QUEUED_TRIALS)
    shape = (shapes or GroupShapes()).read(session, {r[0] for r in rows})
    out: list[QueuedGroup] = []
    for sel_id, trial_id, job_id, owner_id, priority, queue, why in rows:
        if trial_id in taken or sel_id not in shape:  # the batch went meanwhile
            continue
        size, devices = shape[sel_id]
        last = out[-1] if out else None
        if last is None or last.selection_id != sel_id or len(last.trial_ids) >= size:
            last = QueuedGroup(sel_id, [], [], owner_id, priority, queue, devices, why)
            out.append(last)
        elif last.wait_reason != why:
            last.wait_reason = MIXED  # the group's reason is written to every trial again
        last.job_ids.append(job_id)
        last.trial_ids.append(trial_id)
    return out


def specs_of(session: Session, job_ids: Iterable[int]) -> list[tuple[int, dict[str, Any], datetime]]:
    """(id, spec, created_at) of the jobs."""
    ids = list(job_ids)
    out: list[tuple[int, dict[str, Any], datetime]] = []
    for i in range(0, len(ids), 500):
        q = select(Job.id, Job.spec, Job.created_at).where(Job.id.in_(ids[i : i + 500]))
        out += [tuple(r) for r in session.execute(q)]
    return out


@dataclass(slots=True)
class BeatRow:
    name: str
    queues: dict[str, Any]
    devices: dict[str, Any]
    last_seen: datetime


_BEATS = select(WorkerBeat.name, WorkerBeat.queues, WorkerBeat.devices, WorkerBeat.last_seen)


def workers_seen(session: Session, *, within_s: float) -> list[BeatRow]:
    """Workers whose heartbeat is recent (plain rows: the scheduler reads them every tick)."""
    cutoff = utcnow() - timedelta(seconds=within_s)
    return [BeatRow(*r) for r in _rows(session, _BEATS) if aware(r.last_seen) >= cutoff]


_BEATS_TEXT = select(
    WorkerBeat.name, cast(WorkerBeat.queues, Text), cast(WorkerBeat.devices, Text), WorkerBeat.last_seen
)


def workers_seen_text(session: Session, *, within_s: float) -> list[tuple[str, str | None, str | None]]:
    """`workers_seen` with each worker's queues and devices left as their JSON text: (name, queues,
    devices). The scheduler decodes a worker's only when its text changed (core/scheduler.py
    Fleet); decoding 500 workers' every tick cost 10-25 ms of a decision."""
    cutoff = utcnow() - timedelta(seconds=within_s)
    return [(r[0], r[1], r[2]) for r in _rows(session, _BEATS_TEXT) if aware(r[3]) >= cutoff]


@dataclass(frozen=True, slots=True)
class ReservedNode:
    """A reservation's node: the columns HeldRow and Reserved both start with, in this order."""

    id: int
    job_id: int
    worker: str
    node_rank: int
    nnodes: int
    slots: int
    gpus: int
    ram_bytes: int


@dataclass(frozen=True, slots=True)
class HeldRow(ReservedNode):
    """A reservation with what the scheduler needs of its job."""

    claimed: bool
    sent_at: datetime | None
    owner_id: int | None
    priority: int
    status: str
    queue: str
    trial_ids: list[int] | None = None
    """A selection group's reservation: its trials (job_id is the first one's job)."""
    selection_id: int | None = None
    owner: str | None = None
    """The worker process that claimed it (None until claimed)."""


_HELD = select(
    Reservation.id,
    Reservation.job_id,
    Reservation.worker,
    Reservation.node_rank,
    Reservation.nnodes,
    Reservation.slots,
    Reservation.gpus,
    Reservation.ram_bytes,
    Reservation.claimed_at.is_not(None),
    Reservation.sent_at,
    Job.owner_id,
    Job.priority,
    Job.status,
    Job.queue,
    Reservation.trial_ids,
    Job.selection_id,
    Reservation.owner,
).join(Job, Job.id == Reservation.job_id)


def reservations(session: Session) -> list[HeldRow]:
    return [HeldRow(*r) for r in _rows(session, _HELD)]


def reservations_of(session: Session, job_ids: Sequence[int]) -> dict[int, list[Reservation]]:
    out: dict[int, list[Reservation]] = {}
    if not job_ids:
        return out
    q = select(Reservation).where(Reservation.job_id.in_(list(job_ids))).order_by(Reservation.node_rank)
    for r in session.scalars(q):
        out.setdefault(r.job_id, []).append(r)
    return out


_RECENT_COLS = (
    Job.owner_id,
    Job.world_size,
    # the times as the driver hands them back (SQLite: text; PostgreSQL: datetimes): SQLAlchemy's
    # parsing of SQLite's text cost more than the rest of the loop (2,400 rows a tick)
    type_coerce(Job.started_at, String),
    type_coerce(Job.finished_at, String),
    Job.status,
    Job.kind,
    Job.selection_id,
    Job.worker,
    Job.id,
)
_START = bindparam("start", type_=Job.finished_at.type)
_KINDS = Job.kind.in_(["job", "trial"])
_STARTED = (_KINDS, Job.started_at.is_not(None))
# running, or ended within the window, or started within it: three disjoint parts, each read
# through an index (status; finished_at; started_at: migration 0018), not a scan of every job.
# Every running job, started or not: the same rows tell which hold no reservation
# (running_and_recent; that was a read of its own, the running jobs' rows read twice a tick)
_RECENT = union_all(
    select(*_RECENT_COLS).where(_KINDS, Job.status == JobStatus.running),
    select(*_RECENT_COLS).where(*_STARTED, Job.status != JobStatus.running, Job.finished_at > _START),
    select(*_RECENT_COLS).where(
        *_STARTED,
        Job.status != JobStatus.running,
        Job.started_at > _START,
        Job.finished_at.is_(None) | (Job.finished_at <= _START),
    ),
)


def _stamp(t: str | datetime) -> float:
    """Unix seconds of a stored time as the driver gives it: SQLite's ISO text (naive UTC) or a
    datetime."""
    d = datetime.fromisoformat(t) if isinstance(t, str) else t
    return (d if d.tzinfo is not None else d.replace(tzinfo=UTC)).timestamp()


def recent_usage(session: Session, *, window_s: float, now: datetime) -> dict[int | None, tuple[int, float]]:
    """`running_and_recent`'s usage alone."""
    return running_and_recent(session, window_s=window_s, now=now, reserved=set())[1]


Unreserved = tuple[int, int | None, int, str | None]
"""A running job that holds no reservation: (id, owner_id, world_size, worker)."""


def running_and_recent(
    session: Session, *, window_s: float, now: datetime, reserved: set[int]
) -> tuple[list[Unreserved], dict[int | None, tuple[int, float]]]:
    """The running jobs (kind `job`) whose ids are not in `reserved` (the jobs the reservations
    the caller has just read hold): started before the scheduler, or their rows were freed, they
    still use their worker's slots (their GPUs the caller takes from what it holds of each job,
    core/scheduler.py _Needs). And recent usage, per user: (slot-minutes their jobs and selection
    groups ran within the last `window_s`, rounded; unix time of their latest start). A running job counts up to now (its latest attempt
    only). A selection group counts its batch's `devices` slots from its claim (the started_at its
    trials share: db/selections.py claim_trials) to the end of its last trial, or up to now while
    one runs; a trial given back to the queue ends nothing. Whole minutes, so short jobs of two
    users weigh the same and the user served longest ago goes first."""
    start_dt = now - timedelta(seconds=window_s)
    start, now_s = start_dt.timestamp(), now.timestamp()
    seconds: dict[int | None, float] = {}
    last: dict[int | None, float] = {}
    # a group's run, by (batch, worker, claim time): [owner, end of its last trial so far]
    runs: dict[tuple[int | None, str | None, float], list[Any]] = {}
    loose: list[Unreserved] = []
    rows = session.connection().execute(_RECENT, {"start": start_dt}).all()
    for owner_id, ws, started, finished, status, kind, selection_id, worker, job_id in rows:
        if status == JobStatus.running and kind == "job" and job_id not in reserved:
            loose.append((job_id, owner_id, ws, worker))
        if started is None:  # running, not started (only a running job's row may lack it)
            continue
        began = _stamp(started)
        if began > last.get(owner_id, 0.0):
            last[owner_id] = began
        ran_to = None if finished is None else min(_stamp(finished), now_s)
        if kind == "trial":
            run = runs.setdefault((selection_id, worker, began), [owner_id, None])
            if status == JobStatus.running:
                run[1] = now_s
            elif status != JobStatus.queued and ran_to is not None:
                run[1] = ran_to if run[1] is None else max(run[1], ran_to)
            continue
        end = now_s if status == JobStatus.running or ran_to is None else ran_to
        begin = max(began, start)
        if end > begin:
            seconds[owner_id] = seconds.get(owner_id, 0.0) + ws * (end - begin)
    if runs:
        devices = {
            sid: batch_devices(request)
            for sid, request in session.connection().execute(
                select(Selection.id, Selection.request).where(Selection.id.in_({k[0] for k in runs}))
            )
        }
        for (sid, _worker, began), (owner_id, end) in runs.items():
            begin = max(began, start)
            if end is not None and end > begin:
                slots = devices.get(sid, 1)
                seconds[owner_id] = seconds.get(owner_id, 0.0) + slots * (end - begin)
    return loose, {u: (round(seconds.get(u, 0.0) / 60), t) for u, t in last.items()}


def _utc(t: datetime) -> datetime:
    return t if t.tzinfo is not None else t.replace(tzinfo=UTC)  # SQLite hands back naive UTC


def batch_devices(request: dict[str, Any] | None) -> int:
    """The devices (rank slots) each group of a batch runs on."""
    return max(int((request or {}).get("devices") or 1), 1)


_LIMITS = select(User.id, User.name, User.max_running_jobs, User.max_ranks, User.max_gpus)


def user_limits(session: Session, *, defaults: dict[str, int]) -> dict[int, tuple[str, dict[str, int]]]:
    """Per user id: (name, their limits or the defaults)."""
    out = {}
    for uid, name, jobs, ranks, gpus in _rows(session, _LIMITS):
        own = {"running_jobs": jobs, "ranks": ranks, "gpus": gpus}
        out[uid] = (name, {k: v if own[k] is None else own[k] for k, v in defaults.items()})
    return out


# ---- freeing ------------------------------------------------------------------------------------


def free_reservations(
    session: Session, *, live: set[str], held: Sequence[HeldRow] | None = None
) -> list[int]:
    """Delete reservations that hold slots for nothing: of jobs no longer queued or running, and
    unclaimed ones on workers whose heartbeat stopped (the job is placed again). A claimed node on
    a dead worker is freed by its lease running out (db/gangs.py expire_gangs). A selection
    group's reservation goes when none of its trials is queued any more (before its claim) or none
    runs under its task (after: the group ended, or its worker died and the trials' leases ran
    out), and an unclaimed one on a dead worker. Returns the job ids whose reservations went.

    `held`: every reservation as `reservations` has just read it (the tick reads them once and
    again only when some went)."""
    conn = session.connection()
    if held is None:
        held = reservations(session)
    alive = (JobStatus.queued, JobStatus.running)
    ids = {
        h.job_id
        for h in held
        if h.trial_ids is None
        and (h.status not in alive or (h.status == JobStatus.queued and h.worker not in live))
    }
    if ids:
        conn.execute(delete(Reservation).where(Reservation.job_id.in_(ids)))
    groups = [h for h in held if h.trial_ids is not None]
    if groups:
        trial_state = {
            tid: (status, owner)
            for tid, status, owner in conn.execute(
                select(Trial.id, Job.status, Job.owner)
                .join(Job, Job.id == Trial.job_id)
                .where(Trial.id.in_(sorted({t for g in groups for t in g.trial_ids or []})))
            )
        }
        gone = []
        for g in groups:
            states = [trial_state.get(t, (None, None)) for t in g.trial_ids or []]
            if g.owner is None:  # not claimed yet
                keep = g.worker in live and any(st == JobStatus.queued for st, _ in states)
            else:
                keep = any(st == JobStatus.running and owner == g.owner for st, owner in states)
            if not keep:
                gone.append(g)
        if gone:
            conn.execute(delete(Reservation).where(Reservation.id.in_([g.id for g in gone])))
            ids |= {g.job_id for g in gone}
    if ids:  # nothing deleted: no COMMIT round trip (the tick's reads go on in this transaction)
        session.commit()
    return sorted(ids)


def mark_unsent(session: Session, *, reservation_ids: Sequence[int]) -> None:
    """The task could not be sent: the next tick sends it again."""
    conn = session.connection()
    if reservation_ids:
        conn.execute(
            update(Reservation).where(Reservation.id.in_(list(reservation_ids))).values(sent_at=None)
        )
        session.commit()


@dataclass(frozen=True, slots=True)
class Order:
    """A reservation's task as its worker sees it: sent (at `sent_at`, the scheduler's stamp) and
    not yet claimed, its job still queued."""

    reservation_id: int
    job_id: int
    sent_at: datetime


def unclaimed_orders(session: Session, *, worker: str) -> list[Order]:
    """The orders sent to `worker` that nobody claimed yet (their jobs queued)."""
    q = (
        select(Reservation.id, Reservation.job_id, Reservation.sent_at)
        .join(Job, Job.id == Reservation.job_id)
        .where(
            Reservation.worker == worker,
            Reservation.claimed_at.is_(None),
            Reservation.sent_at.is_not(None),
            Job.status == JobStatus.queued,
        )
    )
    return [Order(*r) for r in _rows(session, q)]


def order_lost(session: Session, *, order: Order) -> bool:
    """Its worker could have taken `order` and never got it: mark it unsent, so the scheduler's
    next tick sends it again. Conditional: an order claimed or sent again meanwhile is left as it
    is (False)."""
    got = session.connection().execute(
        update(Reservation)
        .where(
            Reservation.id == order.reservation_id,
            Reservation.claimed_at.is_(None),
            Reservation.sent_at == order.sent_at,
        )
        .values(sent_at=None)
    )
    session.commit()
    return rowcount(got) == 1


def preempt_pending(session: Session) -> set[int]:
    """Running jobs asked to checkpoint and requeue that have not yet given their slots back."""
    q = select(Job.id).where(Job.status == JobStatus.running, Job.preempt_requested.is_(True))
    return {r[0] for r in _rows(session, q)}


def mark_sent(session: Session, *, reservation_ids: Sequence[int]) -> None:
    conn = session.connection()
    if reservation_ids:
        conn.execute(
            update(Reservation).where(Reservation.id.in_(list(reservation_ids))).values(sent_at=utcnow())
        )
        session.commit()


def lock_held(session: Session, *, holder: str, until: datetime, name: str = LOCK) -> bool:
    """Open a transaction that holds the lock row: true when `holder` holds the lock's lease past
    `until` (the caller's bound on the database's time now plus what its writes may take). A
    conditional UPDATE, so the row stays locked to the commit (PostgreSQL: no other scheduler's
    `acquire_lock` passes meanwhile; SQLite: the transaction is a writer from here). False: the
    transaction is rolled back and nothing should be written."""
    res = session.connection().execute(
        update(SchedulerLock)
        .where(SchedulerLock.name == name, SchedulerLock.holder == holder, SchedulerLock.lease_until > until)
        .values(lease_until=SchedulerLock.lease_until)
    )
    if rowcount(res) == 1:
        return True
    session.rollback()
    return False


_IDS: BindParameter[Any] = bindparam("ids")
_SET_REASON_PG = (
    update(Job)
    .where(Job.id == func.any(cast(_IDS, ARRAY(Integer))), Job.status == JobStatus.queued)
    .values(wait_reason=bindparam("why"))
)
_SET_REASON_SQLITE = (
    update(Job)
    .where(
        Job.id.in_(select(func.json_each(_IDS).table_valued("value").c.value)),
        Job.status == JobStatus.queued,
    )
    .values(wait_reason=bindparam("why"))
)


def set_wait_reasons(session: Session, reasons: Mapping[int, str | None]) -> None:
    """Write the reasons that changed (the caller passes only those), queued jobs only, and commit:
    one UPDATE per distinct reason, its job ids sent as one parameter (PostgreSQL: an array,
    `id = ANY(...)`; SQLite: a JSON array read by json_each). When the job blocking the queue's
    head is placed, thousands of waiting jobs get a handful of new texts ("behind higher-priority
    job N"): a handful of statements, however many jobs, never near SQLite's limit on bound
    parameters, and no IN list rendered id by id (that alone cost 30 ms of 11,800 ids)."""
    if not reasons:
        return
    conn = session.connection()
    by_reason: dict[str | None, list[int]] = {}
    for job_id, why in reasons.items():
        by_reason.setdefault(why, []).append(job_id)
    if session.get_bind().dialect.name == "postgresql":
        for why, ids in by_reason.items():
            conn.execute(_SET_REASON_PG, {"ids": ids, "why": why})
    else:
        for why, ids in by_reason.items():
            conn.execute(_SET_REASON_SQLITE, {"ids": json.dumps(ids), "why": why})
    session.commit()


def request_preemption(session: Session, *, job_ids: Sequence[int], by_job: int) -> list[int]:
    """Ask running jobs to checkpoint and go back to the queue; returns those newly asked."""
    asked = []
    for job_id in job_ids:
        res = session.execute(
            update(Job)
            .where(Job.id == job_id, Job.status == JobStatus.running, Job.preempt_requested.is_(False))
            .values(preempt_requested=True, wait_reason=f"preempted by job {by_job}")
        )
        if rowcount(res) == 1:
            asked.append(job_id)
    session.commit()
    return asked


# ---- reserving ----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Reserved(ReservedNode):
    """One reserved node, as written."""

    attempt: int
    created_at: datetime
    sent_at: datetime | None
    trial_ids: list[int] | None = None


@dataclass(frozen=True, slots=True)
class Node:
    worker: str
    slots: int
    gpus: int
    ram_bytes: int


@dataclass(frozen=True, slots=True)
class Capacity:
    slots: int
    tasks: int
    gpus: int
    ram_bytes: int


# reserve's statements, built once (a placement runs seven of them)
_LOCK_WORKERS = (
    update(WorkerBeat)
    .where(WorkerBeat.name.in_(bindparam("workers", expanding=True)))
    .values(name=WorkerBeat.name)
)
_TAKE_JOB = (
    update(Job)
    .where(Job.id == bindparam("job"), Job.status == JobStatus.queued, Job.cancel_requested.is_(False))
    .values(
        nnodes=bindparam("n_nodes", type_=Integer),
        wait_reason=None,
        enqueued_at=bindparam("at", type_=Job.enqueued_at.type),
    )
    .returning(Job.attempts, Job.owner_id, Job.world_size, Job.spec)
)
_LOCK_OWNER = update(User).where(User.id == bindparam("owner")).values(id=User.id).returning(User.name)
# every reservation on the chosen workers and, with a quota, of the owner's other jobs: one read
# for both counts
_RESERVED_ROOM = select(
    Reservation.worker,
    Reservation.job_id,
    Reservation.slots,
    Reservation.gpus,
    Reservation.ram_bytes,
    Job.owner_id,
).join(Job, Job.id == Reservation.job_id)
"""What a reservation holds and whose job it is: the rows the room and quota counts read."""
_HELD_ON = _RESERVED_ROOM.where(
    Reservation.worker.in_(bindparam("workers", expanding=True))
    | ((Job.owner_id == bindparam("owner")) & (Job.id != bindparam("job")))
)
_INSERT = insert(Reservation).returning(Reservation.id, sort_by_parameter_order=True)


def reserve(
    session: Session,
    *,
    job_id: int,
    nodes: Sequence[Node],
    capacity: dict[str, Capacity],
    quota: dict[str, int] | None = None,
    trial_ids: Sequence[int] | None = None,
    gpus_of: GpusOf | None = None,
) -> list[Reserved] | None:
    """Reserve all nodes of job `job_id` in one transaction, or nothing. Conditional: the workers'
    rows are written first (a row lock on Postgres, the write lock on SQLite); the job must still
    be queued and unreserved; with `quota` (the owner's limits) the owner's row is locked too;
    then what the workers hold (and the owner uses) is counted again inside the transaction.
    Two schedulers (or a scheduler and a stale one) can never book the same slots twice. Returns
    the rows, or None when anything changed since the caller looked.

    `trial_ids`: a selection group (one node; `job_id` is its first trial's job): every trial
    must still be queued and held by no other group's reservation. `gpus_of`: the GPUs of the
    owner's running jobs without a reservation, as the caller keeps them (owner_quota_problem)."""
    conn = session.connection()
    workers = sorted({n.worker for n in nodes})
    try:
        # the lock first: on SQLite this write makes the transaction a writer before any read
        conn.execute(_LOCK_WORKERS, {"workers": workers})
        if trial_ids is not None:
            _lock_selections(session, trial_ids)
        job = conn.execute(_TAKE_JOB, {"job": job_id, "n_nodes": len(nodes), "at": utcnow()}).first()
        if job is None:
            session.rollback()
            return None
        if trial_ids is not None and not _group_free(session, trial_ids):
            session.rollback()
            return None
        owner = job.owner_id if quota is not None else None
        name = conn.scalar(_LOCK_OWNER, {"owner": owner}) if owner is not None else None
        used: dict[str, list[int]] = {}
        mine: tuple[set[int], int, int] = (set(), 0, 0)  # the owner's other reserved jobs, slots, GPUs
        for worker, held_job, slots, gpus, ram, owner_id in conn.execute(
            _HELD_ON, {"workers": workers, "owner": owner, "job": job_id}
        ):
            if worker in workers:
                u = used.setdefault(worker, [0, 0, 0, 0])
                u[0], u[1], u[2], u[3] = u[0] + slots, u[1] + gpus, u[2] + ram, u[3] + 1
            if owner is not None and owner_id == owner and held_job != job_id:
                mine = (mine[0] | {held_job}, mine[1] + slots, mine[2] + gpus)
        want: dict[str, list[int]] = {}
        for n in nodes:
            w = want.setdefault(n.worker, [0, 0, 0, 0])
            w[0] += n.slots
            w[1] += n.gpus
            w[2] += n.ram_bytes
            w[3] += 1
        for worker, (slots, gpus, ram, tasks) in want.items():
            cap, u = capacity[worker], used.get(worker, [0, 0, 0, 0])
            if (
                u[0] + slots > cap.slots
                or u[1] + gpus > cap.gpus
                or u[2] + ram > cap.ram_bytes
                or u[3] + tasks > cap.tasks
            ):
                session.rollback()
                return None
        if owner is not None and quota is not None:
            why = owner_quota_problem(
                session,
                name=name,
                owner_id=owner,
                job_id=job_id,
                limits=quota,
                job_ranks=sum(n.slots for n in nodes),
                job_gpus=sum(n.gpus for n in nodes),
                held=(len(mine[0]), mine[1], mine[2]),
                gpus_of=gpus_of,
            )
            if why is not None:
                session.rollback()
                return None
        now = utcnow()
        rows = [
            {
                "job_id": job_id,
                "worker": n.worker,
                "node_rank": rank,
                "nnodes": len(nodes),
                "slots": n.slots,
                "gpus": n.gpus,
                "ram_bytes": n.ram_bytes,
                "attempt": job.attempts,
                "created_at": now,
                "sent_at": now,
                "trial_ids": list(trial_ids) if trial_ids is not None else None,
            }
            for rank, n in enumerate(nodes)
        ]
        ids = conn.scalars(_INSERT, rows).all()
        session.commit()
    except IntegrityError:  # the job was reserved by someone else meanwhile
        session.rollback()
        return None
    return [Reserved(id=i, **r) for i, r in zip(ids, rows, strict=True)]


@dataclass(frozen=True, slots=True)
class Ask:
    """One job's placement for `reserve_many`: its nodes, and its owner's limits (None: no quota
    check, as `reserve`'s `quota`)."""

    job_id: int
    nodes: Sequence[Node]
    quota: dict[str, int] | None = None


# reserve_many's statements: the same checks as reserve's, each run once for all of a tick's jobs
_FREE_JOBS = (
    select(Job.id, Job.attempts, Job.owner_id)
    .where(
        Job.id.in_(bindparam("jobs", expanding=True)),
        Job.status == JobStatus.queued,
        Job.cancel_requested.is_(False),
        Job.id.not_in(select(Reservation.job_id)),
    )
    .order_by(Job.id)
    .with_for_update(of=Job)
)
_LOCK_OWNERS = (
    update(User)
    .where(User.id.in_(bindparam("owners", expanding=True)))
    .values(id=User.id)
    .returning(User.id, User.name)
)
_HELD_ON_MANY = _RESERVED_ROOM.where(
    Reservation.worker.in_(bindparam("workers", expanding=True))
    | Job.owner_id.in_(bindparam("owners", expanding=True))
)
_LOOSE_OF = select(Job.id, Job.owner_id, Job.world_size).where(
    Job.owner_id.in_(bindparam("owners", expanding=True)),
    Job.kind == "job",
    Job.status == JobStatus.running,
    Job.id.not_in(select(Reservation.job_id)),
)
_TAKE_JOBS = (
    update(Job)
    .where(Job.id.in_(bindparam("jobs", expanding=True)))
    .values(
        nnodes=bindparam("n_nodes", type_=Integer),
        wait_reason=None,
        enqueued_at=bindparam("at", type_=Job.enqueued_at.type),
    )
)


def _room(cap: Capacity, used: Sequence[int] | None, want: Sequence[int]) -> bool:
    """Whether a worker of capacity `cap` holding `used` (slots, GPUs, host memory, tasks) has room
    for `want` more."""
    u = used or (0, 0, 0, 0)
    return (
        u[0] + want[0] <= cap.slots
        and u[1] + want[1] <= cap.gpus
        and u[2] + want[2] <= cap.ram_bytes
        and u[3] + want[3] <= cap.tasks
    )


def reserve_many(
    session: Session,
    *,
    asks: Sequence[Ask],
    capacity: dict[str, Capacity],
    gpus_of: GpusOf | None = None,
) -> dict[int, list[Reserved]]:
    """`reserve` for several jobs (no selection groups) in one transaction: each job gets its
    nodes, or nothing, exactly as if `reserve` had been called for each in turn (a job is checked
    against what the jobs before it in `asks` took), in about seven statements for all of them
    instead of seven each (a tick that placed 18 jobs spent 46 ms in their reservations on
    PostgreSQL, bench/scale.py). The same locks in the same order: the workers' rows, the jobs'
    (FOR UPDATE: still queued, not cancelled, unreserved), their owners' (where a quota applies);
    then what the workers hold and the owners use is counted inside the transaction. Returns the
    rows of the jobs reserved, by job id.

    Another scheduler's reservation of one of the jobs, not yet committed when the jobs were read,
    ends this transaction at its insert (the unique node rank): then each job is reserved by
    `reserve`, one at a time."""
    if not asks:
        return {}
    conn = session.connection()
    chosen = {n.worker for a in asks for n in a.nodes}
    workers = sorted(chosen)
    try:
        conn.execute(_LOCK_WORKERS, {"workers": workers})  # first: SQLite's transaction a writer
        jobs = {r[0]: r for r in conn.execute(_FREE_JOBS, {"jobs": sorted({a.job_id for a in asks})})}
        owners: list[int] = sorted(
            {
                o
                for a in asks
                if a.quota is not None and a.job_id in jobs and (o := jobs[a.job_id][2]) is not None
            }
        )
        names: dict[int, str] = {}
        for uid, name in conn.execute(_LOCK_OWNERS, {"owners": owners}) if owners else ():
            names[uid] = name
        used: dict[str, list[int]] = {}
        # per owner with a quota to check: [jobs, slots, GPUs] of their reservations and running jobs,
        # counted on as jobs are taken
        usage: dict[int, list[int]] = {o: [0, 0, 0] for o in owners}
        held_jobs: dict[int, set[int]] = {o: set() for o in owners}
        for worker, held_job, slots, gpus, ram, owner_id in conn.execute(
            _HELD_ON_MANY, {"workers": workers, "owners": owners}
        ):
            if worker in chosen:
                u = used.setdefault(worker, [0, 0, 0, 0])
                u[0], u[1], u[2], u[3] = u[0] + slots, u[1] + gpus, u[2] + ram, u[3] + 1
            if owner_id in usage:
                held_jobs[owner_id].add(held_job)
                u = usage[owner_id]
                u[1], u[2] = u[1] + slots, u[2] + gpus
        for o, held in held_jobs.items():
            usage[o][0] += len(held)
        loose: Sequence[Any] = conn.execute(_LOOSE_OF, {"owners": owners}).all() if owners else []
        loose_gpus = (gpus_of or _spec_gpus)(session, [r[0] for r in loose]) if loose else {}
        for job_id, owner_id, ws in loose:
            u = usage[owner_id]
            u[0], u[1], u[2] = u[0] + 1, u[1] + ws, u[2] + loose_gpus.get(job_id, 0)
        taken: list[tuple[Ask, int]] = []  # (ask, attempt)
        for a in asks:
            job = jobs.pop(a.job_id, None)  # popped: a job asked twice is taken once
            if job is None:
                continue
            want: dict[str, list[int]] = {}
            for n in a.nodes:
                w = want.setdefault(n.worker, [0, 0, 0, 0])
                w[0], w[1], w[2], w[3] = w[0] + n.slots, w[1] + n.gpus, w[2] + n.ram_bytes, w[3] + 1
            if not all(_room(capacity[worker], used.get(worker), w) for worker, w in want.items()):
                continue
            ranks, gpus = sum(n.slots for n in a.nodes), sum(n.gpus for n in a.nodes)
            owner: int | None = job[2]
            if owner is not None and (mine := usage.get(owner)) is not None:
                if a.quota is not None and quota_reason(
                    names.get(owner) or str(owner),
                    a.quota,
                    running=mine[0],
                    ranks=mine[1],
                    gpus=mine[2],
                    job_ranks=ranks,
                    job_gpus=gpus,
                ):
                    continue
                # a job taken counts against its owner's quota for the jobs after it, checked or not
                mine[0], mine[1], mine[2] = mine[0] + 1, mine[1] + ranks, mine[2] + gpus
            for worker, w in want.items():
                u = used.setdefault(worker, [0, 0, 0, 0])
                u[0], u[1], u[2], u[3] = u[0] + w[0], u[1] + w[1], u[2] + w[2], u[3] + w[3]
            taken.append((a, job[1]))
        if not taken:
            session.rollback()
            return {}
        now = utcnow()
        by_nodes: dict[int, list[int]] = {}
        for a, _ in taken:
            by_nodes.setdefault(len(a.nodes), []).append(a.job_id)
        for n_nodes, taken_ids in by_nodes.items():
            conn.execute(_TAKE_JOBS, {"jobs": taken_ids, "n_nodes": n_nodes, "at": now})
        rows: list[dict[str, Any]] = [
            {
                "job_id": a.job_id,
                "worker": n.worker,
                "node_rank": rank,
                "nnodes": len(a.nodes),
                "slots": n.slots,
                "gpus": n.gpus,
                "ram_bytes": n.ram_bytes,
                "attempt": attempt,
                "created_at": now,
                "sent_at": now,
                "trial_ids": None,
            }
            for a, attempt in taken
            for rank, n in enumerate(a.nodes)
        ]
        ids = conn.scalars(_INSERT, rows).all()
        session.commit()
    except IntegrityError:  # one of the jobs was reserved by someone else meanwhile
        session.rollback()
        out: dict[int, list[Reserved]] = {}
        for a in asks:
            got = reserve(
                session, job_id=a.job_id, nodes=a.nodes, capacity=capacity, quota=a.quota, gpus_of=gpus_of
            )
            if got is not None:
                out[a.job_id] = got
        return out
    done: dict[int, list[Reserved]] = {}
    for i, r in zip(ids, rows, strict=True):
        done.setdefault(r["job_id"], []).append(Reserved(id=i, **r))
    return done


def _lock_selections(session: Session, trial_ids: Sequence[int]) -> None:
    """Lock the selection rows of a group's trials (Postgres: FOR UPDATE, held to the commit), so
    two schedulers (one with a lapsed lease, still mid-tick) reserving overlapping groups of one
    batch on different workers take turns: the worker-row lock orders only groups on the same
    worker, and without this both read the trials as free and both booked them. The second's
    reads come after the first's commit (READ COMMITTED reads each statement afresh) and see its
    reservation. Taken after the workers' rows and before any job row, the order every
    reservation locks in, so two reservations never wait on each other in a cycle. SQLite has one
    writer at a time already."""
    selections = select(Trial.selection_id).where(Trial.id.in_(sorted(set(trial_ids)))).distinct()
    session.connection().execute(
        select(Selection.id).where(Selection.id.in_(selections)).order_by(Selection.id).with_for_update()
    ).all()


def _group_free(session: Session, trial_ids: Sequence[int]) -> bool:
    """Every trial of the group is queued and no other group's reservation holds any of them;
    their jobs' wait reasons are cleared (in the caller's transaction). The caller has locked the
    group's selection (`_lock_selections`)."""
    conn = session.connection()
    ids = set(trial_ids)
    for held in conn.scalars(select(Reservation.trial_ids).where(Reservation.trial_ids.is_not(None))):
        if ids & set(held or []):
            return False
    rows = conn.execute(
        select(Job.id, Job.status).join(Trial, Trial.job_id == Job.id).where(Trial.id.in_(sorted(ids)))
    ).all()
    if len(rows) != len(ids) or any(st != JobStatus.queued for _, st in rows):
        return False
    conn.execute(update(Job).where(Job.id.in_([j for j, _ in rows])).values(wait_reason=None))
    return True


_LOOSE = select(Job.id, Job.world_size).where(
    Job.owner_id == bindparam("owner"),
    Job.kind == "job",
    Job.status == JobStatus.running,
    Job.id != bindparam("job"),
    Job.id.not_in(select(Reservation.job_id)),
)


GpusOf = Callable[[Session, Sequence[int]], Mapping[int, int]]
"""The GPUs each of some jobs asks for, by id (a job gone meanwhile may be left out)."""


def _spec_gpus(session: Session, job_ids: Sequence[int]) -> dict[int, int]:
    return {job_id: spec_gpus(spec) for job_id, spec, _ in specs_of(session, job_ids)}


def owner_quota_problem(
    session: Session,
    *,
    owner_id: int,
    job_id: int,
    limits: dict[str, int],
    job_ranks: int,
    job_gpus: int,
    name: str | None = None,
    held: tuple[int, int, int] | None = None,
    gpus_of: GpusOf | None = None,
) -> str | None:
    """The quota reason for job `job_id` (job_ranks, job_gpus) given the owner's other reserved
    jobs and selection groups and running jobs without a reservation (counted in the caller's
    transaction). `name`: the owner's, and `held`: (jobs, slots, GPUs) of the owner's other
    reservations, when the caller has them; `gpus_of`: the GPUs of jobs by id, as the caller keeps
    them (a job's spec never changes), else read from their specs."""
    conn = session.connection()
    if held is None:
        held = conn.execute(
            select(
                func.count(func.distinct(Reservation.job_id)),
                func.coalesce(func.sum(Reservation.slots), 0),
                func.coalesce(func.sum(Reservation.gpus), 0),
            )
            .join(Job, Job.id == Reservation.job_id)
            .where(Job.owner_id == owner_id, Job.id != job_id)
        ).one()
    loose = conn.execute(_LOOSE, {"owner": owner_id, "job": job_id}).all()
    gpus = (gpus_of or _spec_gpus)(session, [r.id for r in loose]) if loose else {}
    if name is None:
        name = conn.scalar(select(User.name).where(User.id == owner_id))
    name = name or str(owner_id)
    return quota_reason(
        name,
        limits,
        running=int(held[0]) + len(loose),
        ranks=int(held[1]) + sum(r.world_size for r in loose),
        gpus=int(held[2]) + sum(gpus.get(r.id, 0) for r in loose),
        job_ranks=job_ranks,
        job_gpus=job_gpus,
    )
