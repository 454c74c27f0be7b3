"""The scheduler: decides which queued job runs where, reserves the slots in the database, then
sends the task(s). Celery only delivers: each worker consumes its own direct queue
(core/broker.py node_queue) and claims only a job reserved for it.

One tick:
1. free reservations of ended jobs and unclaimed ones on workers whose heartbeat stopped; re-send
   the task of a reservation nobody claimed (a lost message);
2. order the queued jobs: effective priority (priority + one per `aging_s` waited, so nothing is
   passed over forever), then fair share between users (the user with the fewest slots running
   now goes first, then the fewest slot-minutes used over the recent window, then the user served
   least recently; each placement in the order counts at once, so two users with equal standing
   alternate), then age;
3. walk that order: a job over its owner's quota waits ("quota: ..."); a job no live worker (or
   gang of workers) could ever hold waits with that reason; a job that fits now is reserved
   (db/scheduling.py reserve: one conditional transaction) and sent; the first job that could fit
   but does not now blocks every job of lower effective priority ("behind higher-priority job N"),
   while jobs of equal effective priority may still fill the gaps;
4. with preemption on, that first blocked job asks lower-priority running jobs on the worker(s) it needs to
   checkpoint and go back to the queue (workers/execute.py treats it like a warm-shutdown drain).

A job needing more ranks than any one worker has gets a gang: the fewest nodes n (n divides its
ranks and GPUs) of equal share each. A selection batch's queued trials take part as groups (up to
its `group_size` trials, in index order): each group asks for the batch's `devices` slots (GPUs
when its trials run on CUDA) and the sum of its trials' host memory on ONE worker, is ordered,
held to quotas and reserved like a job, and its task (`run_selection`) goes to that worker's
queue; the groups of one batch spread over as many workers as have room. The decision itself
(`plan`) is pure and runs on plain values, so tests and bench/sched.py drive it without a database.
"""

from __future__ import annotations

import heapq
import json
import logging
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from core.settings import Settings
from db import scheduling as dbs
from db.jobs import aware, db_now
from db.models import JobStatus, WorkerBeat
from db.quotas import job_gpus, quota_reason
from jobrules.hostmem import host_memory_bytes

log = logging.getLogger(__name__)
GiB = 2**30


@dataclass(slots=True)
class Want:
    """What a queued job asks for."""

    id: int
    user: int | None
    priority: int
    created: float
    """Unix seconds it was submitted."""
    ranks: int
    gpus: int = 0
    ram: int = 0
    queue: str = "cpu"
    eff: int = 0
    """Effective priority (set by order_queue)."""
    trials: tuple[int, ...] = ()
    """A selection group: its trial ids (`id` is the first trial's job). Empty for a job."""
    members: tuple[int, ...] = ()
    """A selection group: its trials' job ids (the first is `id`)."""
    selection: int | None = None


@dataclass(slots=True)
class Box:
    """A live worker: its inventory and what is free now."""

    name: str
    queues: frozenset[str]
    slots: int
    tasks: int
    gpus: int
    ram: int
    free_slots: int = -1
    free_tasks: int = -1
    free_gpus: int = -1
    free_ram: int = -1

    def __post_init__(self) -> None:
        if self.free_slots < 0:
            self.free_slots, self.free_tasks, self.free_gpus, self.free_ram = (
                self.slots,
                self.tasks,
                self.gpus,
                self.ram,
            )

    def fits(self, ranks: int, gpus: int, ram: int, *, now: bool) -> bool:
        if now:
            return (
                self.free_slots >= ranks
                and self.free_gpus >= gpus
                and self.free_ram >= ram
                and self.free_tasks >= 1
            )
        return self.slots >= ranks and self.gpus >= gpus and self.ram >= ram and self.tasks >= 1

    def take(self, ranks: int, gpus: int, ram: int) -> None:
        self.free_slots -= ranks
        self.free_gpus -= gpus
        self.free_ram -= ram
        self.free_tasks -= 1


@dataclass(slots=True)
class Running:
    """A running job's share of one worker, for preemption."""

    job_id: int
    priority: int
    box: str
    slots: int
    gpus: int
    ram: int
    preempt_requested: bool = False


@dataclass(slots=True)
class Quota:
    name: str
    limits: dict[str, int]
    running: int = 0
    ranks: int = 0
    gpus: int = 0


@dataclass(slots=True)
class Decision:
    order: list[Want] = field(default_factory=list)
    placements: list[tuple[Want, list[tuple[str, int, int, int]]]] = field(default_factory=list)
    """(job, [(worker, slots, gpus, ram) per node rank])"""
    reasons: dict[int, str] = field(default_factory=dict)
    preempt: list[int] = field(default_factory=list)
    preempt_for: int | None = None


NO_USE = (0, 0.0)


def effective_priority(priority: int, waited_s: float, aging_s: float) -> int:
    return priority + (int(max(waited_s, 0.0) // aging_s) if aging_s > 0 else 0)


def order_queue(
    wants: Iterable[Want],
    *,
    now: float,
    aging_s: float,
    running_slots: dict[int | None, int],
    recent: dict[int | None, tuple[int, float]],
    fair: bool = True,
) -> list[Want]:
    """The scheduler's order (queue positions are 1-based indexes into it): effective priority
    first; within one, the user with the fewest slots running goes next (then the fewest recent
    slot-minutes, then the one whose latest job started longest ago, then the oldest waiting job)
    and is charged the job's ranks at once; then age. `recent`: user -> (slot-minutes in the
    window, unix time of their latest start)."""
    buckets: dict[int, dict[int | None, list[Want]]] = {}
    for w in wants:
        w.eff = effective_priority(w.priority, now - w.created, aging_s)
        buckets.setdefault(w.eff, {}).setdefault(w.user, []).append(w)
    if not fair:  # plain priority-then-FIFO (bench/sched.py compares it with fair share)
        return sorted(
            (w for b in buckets.values() for ws in b.values() for w in ws),
            key=lambda w: (-w.eff, w.created, w.id),
        )
    running = dict(running_slots)
    out: list[Want] = []
    for eff in sorted(buckets, reverse=True):
        out.extend(fair_bucket(buckets[eff], running, recent))
    return out


def fair_bucket(
    per_user: dict[int | None, list[Want]],
    running: dict[int | None, int],
    recent: dict[int | None, tuple[int, float]],
) -> Iterator[Want]:
    """One effective priority's jobs in fair-share order (order_queue's rule): the user with the
    fewest slots running goes next (then the fewest recent slot-minutes, then the one whose latest
    job started longest ago, then their oldest waiting job), charged the job's ranks in `running`
    at once. Lazy: a caller that stops early has charged only the jobs it took."""
    heap = []
    for user, jobs in per_user.items():
        jobs.sort(key=lambda w: (w.created, w.id), reverse=True)  # pop() takes the oldest
        first = jobs[-1]
        heap.append((running.get(user, 0), recent.get(user, NO_USE), first.created, first.id, user))
    heapq.heapify(heap)
    while heap:
        _, _, _, _, user = heapq.heappop(heap)
        jobs = per_user[user]
        w = jobs.pop()
        running[user] = running.get(user, 0) + w.ranks
        yield w
        if jobs:
            nxt = jobs[-1]
            heapq.heappush(heap, (running[user], recent.get(user, NO_USE), nxt.created, nxt.id, user))


def gang_shape(w: Want, boxes: Sequence[Box]) -> int | None:
    """Nodes the job needs on this fleet (when all its boxes are empty): 1 when one worker can hold
    it, else the fewest n >= 2 that divides its ranks (and GPUs) with n workers big enough for a
    share each; None when no such gang exists."""
    fit = [b for b in boxes if w.queue in b.queues]
    if any(b.fits(w.ranks, w.gpus, w.ram, now=False) for b in fit):
        return 1
    for n in range(2, min(len(fit), w.ranks) + 1):
        if w.ranks % n or w.gpus % n:
            continue
        share = (w.ranks // n, w.gpus // n, -(-w.ram // n))
        if sum(1 for b in fit if b.fits(*share, now=False)) >= n:
            return n
    return None


def _place(w: Want, n: int, boxes: Sequence[Box]) -> list[tuple[str, int, int, int]] | None:
    """Best fit now: the workers with the least room that still hold a share."""
    share = (w.ranks // n, w.gpus // n, -(-w.ram // n))
    ok = [b for b in boxes if w.queue in b.queues and b.fits(*share, now=True)]
    if len(ok) < n:
        return None
    ok.sort(key=lambda b: (b.free_slots, b.free_gpus, b.free_ram, b.name))
    chosen = ok[:n]
    for b in chosen:
        b.take(*share)
    return [(b.name, *share) for b in chosen]


def _quota_problem(w: Want, quotas: dict[int, Quota]) -> str | None:
    q = quotas.get(w.user) if w.user is not None else None
    if q is None:
        return None
    why = quota_reason(
        q.name, q.limits, running=q.running, ranks=q.ranks, gpus=q.gpus, job_ranks=w.ranks, job_gpus=w.gpus
    )
    return f"quota: {why}" if why else None


def _holds(free: Sequence[int], share: tuple[int, int, int]) -> bool:
    """Whether free (slots, GPUs, host memory, tasks) hold one node's share and one more task."""
    return free[0] >= share[0] and free[1] >= share[1] and free[2] >= share[2] and free[3] >= 1


def _preemption(w: Want, n: int, boxes: Sequence[Box], running: Sequence[Running]) -> list[int]:
    """The fewest lower-priority running jobs whose slots would let `w` fit: its share on each of
    the `n` workers it needs (n > 1 for a gang). A worker that already holds a share costs nothing;
    a gang that must displace jobs on several workers asks all of them at once."""
    if any(r.preempt_requested for r in running):
        return []  # one preemption at a time: wait for the asked jobs to give their slots back
    share = (w.ranks // n, w.gpus // n, -(-w.ram // n))
    costs: list[tuple[int, str, list[int]]] = []  # (victims, worker, victims' job ids) per worker
    for b in boxes:
        if w.queue not in b.queues or not b.fits(*share, now=False):
            continue
        victims = sorted(
            (r for r in running if r.box == b.name and r.priority < w.priority), key=lambda r: r.priority
        )
        free = [b.free_slots, b.free_gpus, b.free_ram, b.free_tasks]
        chosen: list[int] = []
        for r in victims:
            if _holds(free, share):
                break
            chosen.append(r.job_id)
            free = [free[0] + r.slots, free[1] + r.gpus, free[2] + r.ram, free[3] + 1]
        if _holds(free, share):
            costs.append((len(chosen), b.name, chosen))
    if len(costs) < n:
        return []
    costs.sort(key=lambda c: (c[0], c[1]))
    asked: list[int] = []
    for _, _, chosen in costs[:n]:
        asked.extend(j for j in chosen if j not in asked)
    return asked


def _short_of(b: Box, share: tuple[int, int, int]) -> list[str]:
    """What of one node's `share` (slots, GPUs, host memory) and one more task worker `b` lacks now,
    slots aside."""
    short = []
    if b.free_tasks < 1:
        short.append(
            f"it runs {b.tasks - b.free_tasks} job(s) already, the most it runs at once (its "
            f"--concurrency is {b.tasks})"
        )
    if b.free_gpus < share[1]:
        short.append(f"{b.free_gpus} of the {share[1]} GPU(s) needed are free")
    if b.free_ram < share[2]:
        short.append(
            f"{b.free_ram / GiB:,.1f} of the {share[2] / GiB:,.1f} GiB of host memory needed are free"
        )
    return short


def busy_reason(w: Want, n: int, boxes: list[Box]) -> str:
    """Why a job the fleet can hold waits: the workers that could are busy now (not too small,
    which `plan` says apart). Names what is short, so a user can tell a full fleet from a big ask:
    free slots, or, where a worker has the slots, what else it lacks (a task: the jobs it runs at
    once; GPUs; host memory)."""
    each = f" on each of {n} workers" if n > 1 else ""
    share = (w.ranks // n, w.gpus // n, -(-w.ram // n))
    mine = [b for b in boxes if w.queue in b.queues and b.fits(*share, now=False)]
    roomy = [(short, b) for b in mine if b.free_slots >= share[0] and (short := _short_of(b, share))]
    if len([b for b in mine if b.free_slots >= share[0]]) >= n and roomy:
        short, b = min(roomy, key=lambda sb: (len(sb[0]), -sb[1].free_slots, sb[1].name))
        return (
            f"workers busy: needs {share[0]} free slot(s){each} and a free task; worker {b.name} has "
            f"{b.free_slots} free slot(s) but {'; '.join(short)} (the fleet can hold it once running "
            f"jobs end)"
        )
    most = max((b.free_slots for b in boxes if w.queue in b.queues), default=0)
    return (
        f"workers busy: needs {share[0]} free slot(s){each}; most free now: {most} "
        f"(the fleet can hold it once running jobs end)"
    )


def plan(
    wants: Iterable[Want],
    boxes: list[Box],
    *,
    now: float,
    aging_s: float,
    running_slots: dict[int | None, int],
    recent: dict[int | None, tuple[int, float]],
    quotas: dict[int, Quota],
    running: Sequence[Running] = (),
    preemption: bool = False,
    fair: bool = True,
) -> Decision:
    """One tick's decision on plain values (boxes' free amounts and quotas are updated in place).
    `fair` False orders by effective priority then age only (FIFO; for bench/sched.py)."""
    order = order_queue(
        wants, now=now, aging_s=aging_s, running_slots=running_slots, recent=recent, fair=fair
    )
    d = Decision(order=order)
    if not boxes:
        d.reasons = {w.id: NO_WORKER for w in d.order}
        return d
    planner = Planner(d, boxes, quotas, running, preemption=preemption)
    for w in d.order:
        planner.consider(w)
    return d


NO_WORKER = "no live worker: waiting for one to start"


class Planner:
    """`plan`'s walk of the order, one job at a time (`consider`), so the incremental scheduler
    (core/queue_cache.py) walks the same code and stops where nothing more can change."""

    def __init__(
        self,
        d: Decision,
        boxes: list[Box],
        quotas: dict[int, Quota],
        running: Sequence[Running],
        *,
        preemption: bool,
    ) -> None:
        self.d, self.boxes, self.quotas, self.running, self.preemption = d, boxes, quotas, running, preemption
        self.blocker: Want | None = None
        self.biggest = max(b.slots for b in boxes)
        # the fleet's shape for each kind of ask
        self.shapes: dict[tuple[int, int, int, str], int | None] = {}
        # asks (share, queue, nodes) that found no room: boxes only fill up during a plan, so they
        # find none later in it either (saves a scan of every box for each of ~1,000 waiting jobs)
        self.full: set[tuple[int, int, int, str, int]] = set()
        # why a job the fleet can hold waits, by ask: the same words for every job of one ask until
        # a placement changes what is free (busy_reason scans every worker: 10,000 waiting jobs on
        # 500 workers were 4 million checks a tick, bench/scale.py)
        self.busy: dict[tuple[int, int, int, str, int], str] = {}

    def nodes_for(self, w: Want) -> int | None:
        """The nodes `w` needs on this fleet; None when no worker (or gang) can ever hold it."""
        key = (w.ranks, w.gpus, w.ram, w.queue)
        if key not in self.shapes:
            self.shapes[key] = gang_shape(w, self.boxes)
        n = self.shapes[key]
        if w.trials and n is not None and n > 1:
            return None  # a group runs as one process on one worker
        return n

    def too_big(self, w: Want) -> str:
        if w.trials:
            return (
                f"no live worker can hold this selection group ({w.ranks} device slot(s), {w.gpus} GPU(s), "
                f"{w.ram / GiB:,.1f} GiB of host memory; largest worker: {self.biggest} slots)"
            )
        return (
            f"no live worker, nor a gang of equal shares, can hold {w.ranks} rank(s), {w.gpus} GPU(s) "
            f"and {w.ram / GiB:,.1f} GiB of host memory (largest worker: {self.biggest} slots; "
            f"{len(self.boxes)} worker(s) alive)"
        )

    def waiting(self, w: Want) -> str | None:
        """Why `w` waits without a look at free room (quota, too big, behind the blocker), or None
        when only room decides: the whole reason of every job past the blocker's priority."""
        if why := _quota_problem(w, self.quotas):
            return why
        if self.nodes_for(w) is None:
            return self.too_big(w)
        if self.blocker is not None and w.eff < self.blocker.eff:
            return f"behind higher-priority job {self.blocker.id}"
        return None

    def waiting_past(self, w: Want, blocker: Want) -> str:
        """`waiting`'s answer for a job of lower effective priority than `blocker`."""
        if why := _quota_problem(w, self.quotas):
            return why
        return self.too_big(w) if self.nodes_for(w) is None else f"behind higher-priority job {blocker.id}"

    def consider(self, w: Want) -> None:
        """Place `w` now, or record why it waits (and, for the first job that could fit but does
        not, which running jobs preemption asks to make room)."""
        d = self.d
        if (why := self.waiting(w)) is not None:
            d.reasons[w.id] = why
            return
        n = self.nodes_for(w)
        assert n is not None
        ask = (w.ranks // n, w.gpus // n, -(-w.ram // n), w.queue, n)
        nodes = None if ask in self.full else _place(w, n, self.boxes)
        if nodes is None:
            self.full.add(ask)
            # the reason stays the same while the job waits (it is written only when it changes)
            if ask not in self.busy:
                self.busy[ask] = busy_reason(w, n, self.boxes)
            d.reasons[w.id] = self.busy[ask]
            if self.blocker is None:
                self.blocker = w
                if self.preemption:
                    d.preempt = _preemption(w, n, self.boxes, self.running)
                    d.preempt_for = w.id if d.preempt else None
                    if d.preempt:
                        d.reasons[w.id] += f"; preempting job(s) {', '.join(map(str, d.preempt))}"
            return
        d.placements.append((w, nodes))
        self.busy.clear()
        if w.user is not None and (q := self.quotas.get(w.user)) is not None:
            q.running, q.ranks, q.gpus = q.running + 1, q.ranks + w.ranks, q.gpus + w.gpus


# ---- the database side of a tick ----------------------------------------------------------------


def box_of(beat: WorkerBeat | dbs.BeatRow) -> Box | None:
    """A live worker's inventory from its heartbeat; None when it reports none or is draining."""
    host = (beat.devices or {}).get("host") or {}
    if host.get("draining") or not host.get("slots"):
        return None
    gpus = sum(1 for d in (beat.devices or {}).get("devices", []) if d.get("type") == "cuda")
    return Box(
        name=beat.name,
        queues=frozenset((beat.queues or {}).get("queues", [])),
        slots=int(host["slots"]),
        tasks=int(host.get("tasks", 1) or 1),
        gpus=gpus,
        ram=int(host.get("ram_bytes", 0) or 0),
    )


class Fleet:
    """The live workers' inventories between ticks, by the text of their heartbeat's queues and
    devices: a worker's JSON is decoded and its Box built again only when that text changed
    (decoding 500 workers' every tick cost 10-25 ms of a decision, bench/scale.py). `boxes` hands
    out fresh Boxes each tick (a tick takes their free room in place)."""

    def __init__(self) -> None:
        self.seen: dict[str, tuple[str | None, str | None, Box | None]] = {}

    def boxes(self, session: Any, *, within_s: float) -> list[Box]:
        """The workers seen within `within_s` that take work (box_of), as fresh Boxes."""
        out: list[Box] = []
        seen: dict[str, tuple[str | None, str | None, Box | None]] = {}
        for name, queues, devices in dbs.workers_seen_text(session, within_s=within_s):
            kept = self.seen.get(name)
            if kept is None or kept[0] != queues or kept[1] != devices:
                beat = dbs.BeatRow(
                    name,
                    json.loads(queues) if queues is not None else None,  # type: ignore[arg-type]
                    json.loads(devices) if devices is not None else None,  # type: ignore[arg-type]
                    datetime.min,
                )
                kept = (queues, devices, box_of(beat))
            seen[name] = kept
            if (b := kept[2]) is not None:
                out.append(Box(b.name, b.queues, b.slots, b.tasks, b.gpus, b.ram))
        self.seen = seen  # workers no longer seen are forgotten
        return out


class _Needs:
    """Per job id: (gpus, host RAM, unix time submitted), from its row, once per scheduler
    process (none of them changes). At most `limit` jobs are kept, the one asked for least
    recently going first: a tick asks only for the running jobs without a reservation, the queued
    groups' trials and the jobs new to the queue (the queue's other jobs keep theirs in the queue
    cache until its full read), so dropping all but one call's ids, as it once did past 20,000,
    threw away the queue's and decoded their specs again on the next full read."""

    def __init__(self, limit: int = 100_000) -> None:
        self.limit = limit
        self.cache: OrderedDict[int, tuple[int, int, float]] = OrderedDict()

    def get(self, session: Any, ids: Iterable[int]) -> dict[int, tuple[int, int, float]]:
        ids = list(ids)
        cache = self.cache
        missing = []
        for i in ids:
            if i in cache:
                cache.move_to_end(i)
            else:
                missing.append(i)
        for job_id, spec, created in dbs.specs_of(session, missing):
            try:
                ram = int(host_memory_bytes(spec)["total"])
            except Exception:  # noqa: BLE001 - an old or odd spec: count no RAM rather than never place it
                ram = 0
            cache[job_id] = (job_gpus(spec), ram, aware(created).timestamp())
        out = {i: cache[i] for i in ids if i in cache}
        while len(cache) > self.limit:
            cache.popitem(last=False)
        return out

    def gpus(self, session: Any, ids: Sequence[int]) -> dict[int, int]:
        """The GPUs of jobs `ids` (db/scheduling.py reserve's `gpus_of`: a user's running jobs
        without a reservation, whose specs a placement decoded each time, 50 a placement here)."""
        return {i: n[0] for i, n in self.get(session, ids).items()}


@dataclass(slots=True)
class State:
    """What one tick read from the database (also what the REST queue view orders)."""

    wants: list[Want]
    boxes: list[Box]
    running_slots: dict[int | None, int]
    recent: dict[int | None, tuple[int, float]]
    quotas: dict[int, Quota]
    running: list[Running]
    held: list[dbs.HeldRow]
    reasons: dict[int, str | None]
    now: float


def read_state(
    session: Any,
    settings: Settings,
    needs: _Needs,
    *,
    beats: Sequence[dbs.BeatRow] | None = None,
    fleet: Sequence[Box] | None = None,
    held: list[dbs.HeldRow] | None = None,
    now: datetime | None = None,
    jobs: bool = True,
    shapes: dbs.GroupShapes | None = None,
) -> State:
    """`beats` (or `fleet`, the live workers' fresh Boxes), `held` (the reservations) and `now`
    (database time): when the caller has just read them. `jobs` False: the queued jobs are left
    out of `wants` (selection groups only; the incremental scheduler, core/queue_cache.py, keeps
    the jobs between ticks). `shapes`: the selection batches' group shapes as the caller keeps
    them between ticks."""
    now_dt = now if now is not None else db_now(session)
    if fleet is not None:
        boxes = {b.name: b for b in fleet}
    else:
        if beats is None:
            beats = dbs.workers_seen(session, within_s=settings.worker_alive_s)
        boxes = {b.name: b for b in (box_of(w) for w in beats) if b is not None}
    if held is None:
        held = dbs.reservations(session)
    wants, reasons = _wants(session, needs, held=held, jobs=jobs, shapes=shapes)
    running_slots: dict[int | None, int] = {}
    limits = dbs.user_limits(session, defaults=settings.quota_defaults)
    quotas = {uid: Quota(name=name, limits=lim) for uid, (name, lim) in limits.items()}
    counted: set[int] = set()
    running: dict[tuple[int, str], Running] = {}
    # only preemption looks at which running jobs were already asked
    preempting = dbs.preempt_pending(session) if settings.preemption else set()
    for h in held:
        if (b := boxes.get(h.worker)) is not None:
            b.free_slots -= h.slots
            b.free_gpus -= h.gpus
            b.free_ram -= h.ram_bytes
            b.free_tasks -= 1
            # a selection group is not preempted; nor is a job reserved but not started yet
            # (request_preemption asks running jobs only: choosing it would ask nobody)
            if h.trial_ids is None and h.status == JobStatus.running:
                running[(h.job_id, h.worker)] = Running(
                    h.job_id, h.priority, h.worker, h.slots, h.gpus, h.ram_bytes, h.job_id in preempting
                )
        if h.job_id not in counted:
            counted.add(h.job_id)
            running_slots[h.owner_id] = running_slots.get(h.owner_id, 0) + h.slots * h.nnodes
            if h.owner_id in quotas:
                q = quotas[h.owner_id]
                q.running += 1
                q.ranks += h.slots * h.nnodes
                q.gpus += h.gpus * h.nnodes
    # the running jobs without a reservation come with the recent usage's rows (one read of them)
    loose, recent = dbs.running_and_recent(
        session, window_s=settings.fair_share_window_s, now=now_dt, reserved={h.job_id for h in held}
    )
    loose_needs = needs.get(session, [r[0] for r in loose])
    for job_id, owner_id, ws, worker in loose:
        if (b := boxes.get(worker or "")) is not None:
            b.free_slots -= ws
            b.free_tasks -= 1
        running_slots[owner_id] = running_slots.get(owner_id, 0) + ws
        if owner_id in quotas:
            q = quotas[owner_id]
            gpus = loose_needs[job_id][0] if job_id in loose_needs else 0
            q.running, q.ranks, q.gpus = q.running + 1, q.ranks + ws, q.gpus + gpus
    # a selection group's reservation counts like a job's: one task, the batch's devices as
    # slots (and GPUs), against its owner's quota as one job (db/quotas.py group_size)
    return State(
        wants=wants,
        boxes=list(boxes.values()),
        running_slots=running_slots,
        recent=recent,
        quotas=quotas,
        running=list(running.values()),
        held=held,
        reasons=reasons,
        now=now_dt.timestamp(),
    )


def _wants(
    session: Any,
    needs: _Needs,
    *,
    held: list[dbs.HeldRow],
    jobs: bool = True,
    shapes: dbs.GroupShapes | None = None,
) -> tuple[list[Want], dict[int, str | None]]:
    """The queued jobs (unless `jobs` is False), then the selection groups no reservation holds
    yet, as wants; each one's wait reason by its (first) job's id."""
    wants, reasons = job_wants(session, needs, dbs.queued_jobs(session)) if jobs else ([], {})
    groups = dbs.queued_groups(session, held=held, shapes=shapes)
    need_t = needs.get(session, [j for g in groups for j in g.job_ids])
    for g in groups:
        if any(j not in need_t for j in g.job_ids):
            continue  # deleted meanwhile
        first = need_t[g.job_ids[0]]
        ranks, gpus = g.devices, g.devices if first[0] else 0
        wants.append(
            Want(
                id=g.job_ids[0],
                user=g.owner_id,
                priority=g.priority,
                created=first[2],
                ranks=ranks,
                gpus=gpus,
                ram=sum(need_t[j][1] for j in g.job_ids),
                queue=g.queue,
                trials=tuple(g.trial_ids),
                members=tuple(g.job_ids),
                selection=g.selection_id,
            )
        )
        reasons[g.job_ids[0]] = g.wait_reason
    return wants, reasons


def job_wants(session: Any, needs: _Needs, queued: Iterable[Any]) -> tuple[list[Want], dict[int, str | None]]:
    """Rows of dbs.queued_jobs as wants, and each one's wait reason by id."""
    queued = list(queued)
    need = needs.get(session, [q[0] for q in queued])
    wants: list[Want] = []
    reasons: dict[int, str | None] = {}
    for job_id, owner_id, priority, world_size, queue, why in queued:
        reasons[job_id] = why
        if (n := need.get(job_id)) is not None:  # else deleted meanwhile
            gpus, ram, created = n
            wants.append(
                Want(
                    id=job_id,
                    user=owner_id,
                    priority=priority,
                    created=created,
                    ranks=world_size,
                    gpus=gpus,
                    ram=ram,
                    queue=queue,
                )
            )
    return wants, reasons


_VIEW_NEEDS: dict[str, _Needs] = {}
"""Per database (job ids of two databases name different jobs)."""


def queue_positions(session: Any, settings: Settings) -> list[Want]:
    """The queued jobs in the scheduler's order (the REST queue view)."""
    st = read_state(session, settings, _VIEW_NEEDS.setdefault(settings.database_url, _Needs()))
    return order_queue(
        st.wants, now=st.now, aging_s=settings.aging_s, running_slots=st.running_slots, recent=st.recent
    )


__all__ = [
    "Box",
    "box_of",
    "Decision",
    "Fleet",
    "Quota",
    "Running",
    "Want",
    "effective_priority",
    "gang_shape",
    "order_queue",
    "plan",
    "queue_positions",
    "read_state",
]
