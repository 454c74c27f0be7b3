"""The scheduler's loop: the process that leads (holds the database's lock row) ticks: it frees
what ended, reads the queue (core/queue_cache.py keeps it between ticks), asks the planner
(core/scheduler.py) for a decision, reserves and sends. Every other scheduler waits for the lock to
lapse."""

from __future__ import annotations

import gc
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from core.broker import node_queue, send_run_job, send_run_selection
from core.queue_cache import QueueCache
from core.scheduler import Decision, Fleet, Want, _Needs, read_state
from core.settings import Settings
from core.slurm import is_pool_node
from core.telemetry import SCHEDULER_DECISION, SCHEDULER_PLACED, SCHEDULER_PLACEMENT, SCHEDULER_TICK
from db import scheduling as dbs
from db.connection import session_for
from db.ingest import add_event
from db.jobs import aware, db_now
from db.models import JobStatus

log = logging.getLogger(__name__)


Sender = Callable[..., None]
WAKE_GAP_S = 0.25
"""Woken ticks start at least this far apart (or scheduler_s, if shorter; a timed tick does not
count, so a lone submit is placed at once): a tick orders the whole
queue, and one per submit cost the API process its latency under a stream of submits (20/s with
hundreds queued: bench/api_load.py)."""
REASONS_MARGIN_S = 1.0
"""The lock's lease must run at least this much past the moment the wait reasons' transaction
starts (a bound on what that transaction takes; the lease is lock_s, 5 s or more)."""


@contextmanager
def collector_paused() -> Iterator[None]:
    """Python's cyclic garbage collector off for the span (back on after, if it was on). A tick
    allocates tens of thousands of short-lived rows, tuples and dicts; a collection in the middle
    of it finds them still alive and promotes them to the oldest generation, and every 15 or so
    ticks that made the interpreter run a full collection of the whole process (90-120 ms) in
    the middle of a decision (bench/scale.py). Off, the tick's garbage goes by reference
    counting as it always does, nothing of it is promoted, and the collections the process still
    needs run between ticks. Process-wide: another thread's allocations meanwhile wait for the
    tick's end to be collected too."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


@dataclass(frozen=True, slots=True)
class TickTimes:
    """A leader's tick, in seconds from its start: `placed`, its placements reserved (committed),
    their tasks sent and any preemption asked, the decision a submitter waits for; `total`, with
    the waiting jobs' reasons written too. `*_cpu`: the same spans' CPU time in the ticking thread
    (wall time on a shared machine moves with its load; this does not)."""

    placed: float
    total: float
    placed_cpu: float
    total_cpu: float


class Scheduler:
    """The loop: `tick` once, or `run` until stopped. Only the holder of the database lock row
    ticks; the others wait for it to lapse."""

    def __init__(
        self,
        settings: Settings,
        *,
        send: Sender = send_run_job,
        send_group: Sender = send_run_selection,
        name: str = "",
    ) -> None:
        self.settings = settings
        self.send = send
        self.send_group = send_group
        self.holder = name or f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self.needs = _Needs()
        self.fleet = Fleet()
        """The live workers' inventories, decoded again only when a heartbeat's text changes."""
        self.shapes = dbs.GroupShapes()
        """The selection batches' group sizes and devices, decoded again only when a request's
        text changes."""
        self.queue = QueueCache()
        """The queued jobs between ticks (read again in full when this scheduler starts to lead)."""
        self.leading = False
        self.last: TickTimes | None = None
        """The last tick that led, timed."""
        self._placed_at = (0.0, 0.0)
        self.wake_event = threading.Event()
        self.stop_event = threading.Event()
        self.thread: threading.Thread | None = None

    @property
    def lock_s(self) -> float:
        return max(5.0, 5 * self.settings.scheduler_s)

    def wake(self) -> None:
        self.wake_event.set()

    def tick(self) -> Decision | None:
        """One pass; None when another scheduler holds the lock."""
        started, cpu = time.perf_counter(), time.thread_time()
        with collector_paused():
            d = self._tick()
        if d is not None:  # a follower's pass is one lock read: not a tick worth timing
            (placed, placed_cpu), end, end_cpu = self._placed_at, time.perf_counter(), time.thread_time()
            self.last = TickTimes(placed - started, end - started, placed_cpu - cpu, end_cpu - cpu)
            SCHEDULER_PLACEMENT.observe(self.last.placed)
            SCHEDULER_TICK.observe(self.last.total)
        return d

    def _tick(self) -> Decision | None:
        s = self.settings
        with session_for(s.database_url) as session:
            clock = time.monotonic()
            now = db_now(session)  # one clock read for the lock and the tick's reads
            if not dbs.acquire_lock(session, holder=self.holder, lease_s=self.lock_s, now=now):
                self.leading = False
                return None
            fresh = not self.leading
            self.leading = True
            fleet = self.fleet.boxes(session, within_s=s.worker_alive_s)
            # a worker that stopped beating or is draining gets its unclaimed reservations back
            held = dbs.reservations(session)
            freed = dbs.free_reservations(session, live={b.name for b in fleet}, held=held)
            if freed:
                log.info("freed the reservations of job(s) %s", freed)
                held = dbs.reservations(session)
            st = read_state(
                session, s, self.needs, fleet=fleet, held=held, now=now, jobs=False, shapes=self.shapes
            )
            try:
                self.queue.refresh(session, self.needs, full=fresh)
            except Exception:
                self.queue.clear()  # read everything again next tick
                raise
            self._resend(session, st.held, everything=fresh)
            decided = time.perf_counter()
            d = self.queue.decide(st, aging_s=s.aging_s, preemption=s.preemption)
            SCHEDULER_DECISION.observe(time.perf_counter() - decided)
            capacity = {b.name: dbs.Capacity(b.slots, b.tasks, b.gpus, b.ram) for b in st.boxes}

            def limits(w: Want) -> dict[str, int] | None:
                return st.quotas[w.user].limits if w.user in st.quotas else None

            # the jobs' reservations in one transaction (seven statements each, one at a time, were
            # 2.5 ms a placement on PostgreSQL); a selection group's in one of its own, as before
            jobs = dbs.reserve_many(
                session,
                asks=[
                    dbs.Ask(w.id, [dbs.Node(*n) for n in nodes], limits(w))
                    for w, nodes in d.placements
                    if not w.trials
                ],
                capacity=capacity,
                gpus_of=self.needs.gpus,
            )
            for w, nodes in d.placements:
                if w.trials:
                    rows = dbs.reserve(
                        session,
                        job_id=w.id,
                        nodes=[dbs.Node(*n) for n in nodes],
                        capacity=capacity,
                        quota=limits(w),
                        trial_ids=w.trials,
                        gpus_of=self.needs.gpus,
                    )
                else:
                    rows = jobs.get(w.id)
                if rows is None:
                    d.reasons.pop(w.id, None)
                    continue
                self.queue.placed(w.id)
                SCHEDULER_PLACED.inc()
                self._send(session, w.id, rows, selection_id=w.selection, fresh=True)
            if d.preempt and d.preempt_for is not None:
                asked = dbs.request_preemption(session, job_ids=d.preempt, by_job=d.preempt_for)
                if asked:
                    log.warning("job %s: asked job(s) %s to checkpoint and requeue", d.preempt_for, asked)
            self._placed_at = (time.perf_counter(), time.thread_time())
            # the database's clock now is at most `now` plus what this process's clock has run since
            self._write_reasons(session, d, until=now + timedelta(seconds=time.monotonic() - clock))
        return d

    def _write_reasons(self, session: Any, d: Decision, *, until: datetime) -> None:
        """The waiting jobs' reasons that changed, in their own transaction after the placements
        (whose reservations are committed and tasks sent already), while this scheduler still
        holds the lock (`until`: a bound on the database's time now). Not written (the lock lapsed,
        or the write failed): logged, and the cache keeps the reasons the database has, so the
        next tick that leads writes them."""
        changes = self.queue.changes(d)
        if not changes:
            return
        try:
            if not dbs.lock_held(
                session, holder=self.holder, until=until + timedelta(seconds=REASONS_MARGIN_S)
            ):
                log.warning("the scheduler lock lapsed before the wait reasons were written")
                self.leading = False  # a scheduler that leads again reads everything first
                return
            dbs.set_wait_reasons(session, {i: why for why, ids in changes.items() for i in ids})
        except Exception:  # noqa: BLE001 - the placements stand; the next tick writes the reasons
            session.rollback()
            log.exception(
                "could not write %d wait reason(s); the next tick writes them",
                sum(map(len, changes.values())),
            )
            return
        self.queue.written(changes)

    def _send(
        self,
        session: Any,
        job_id: int,
        rows: Sequence[Any],
        *,
        selection_id: int | None = None,
        fresh: bool = False,
    ) -> None:
        """`fresh`: rows `reserve` has just written, whose sent_at is already this moment (no
        second write for them; a failed send still clears it)."""
        sent = []
        for r in rows:
            if is_pool_node(r.worker):  # a Slurm pool's submitter reads the reservation itself
                sent.append(r.id)
                continue
            try:
                if r.trial_ids is not None:  # a selection group's task
                    self.send_group(
                        self.settings,
                        selection_id=selection_id,
                        trial_ids=list(r.trial_ids),
                        queue=node_queue(r.worker),
                        reservation_id=r.id,
                    )
                else:
                    self.send(
                        self.settings,
                        job_id=job_id,
                        queue=node_queue(r.worker),
                        node_rank=r.node_rank,
                        nnodes=r.nnodes,
                    )
                sent.append(r.id)
            except Exception as e:  # noqa: BLE001 - the broker is down: sent again next tick
                log.warning("job %s: could not send node %s's task: %s", job_id, r.node_rank, e)
                dbs.mark_unsent(session, reservation_ids=[r.id])
                if r.sent_at is not None:  # the first failure goes in the job's log, not every retry
                    add_event(
                        session, job_id=job_id, kind="log", message=f"broker unavailable, will retry: {e}"
                    )
        if not fresh:
            dbs.mark_sent(session, reservation_ids=sent)

    def _resend(self, session: Any, held: Sequence[dbs.HeldRow], *, everything: bool) -> None:
        """Tasks nobody claimed: unsent (the broker was down, or their worker marked them lost: it
        could have taken them for lost_order_s and never got them, workers/intake.py), sent
        requeue_after_s ago (the last resort, whatever the worker said), or all of them when this
        scheduler has just taken over (the broker may have restarted empty)."""
        cutoff = time.time() - self.settings.requeue_after_s
        by_job: dict[int, list[dbs.HeldRow]] = {}
        for h in held:
            if h.claimed or h.status != JobStatus.queued:
                continue
            if everything or h.sent_at is None or aware(h.sent_at).timestamp() < cutoff:
                by_job.setdefault(h.job_id, []).append(h)
        for job_id, rows in by_job.items():
            self._send(session, job_id, rows, selection_id=rows[0].selection_id)

    def run(self) -> None:
        """Tick every scheduler_s (sooner when woken, woken ticks at least WAKE_GAP_S apart) until
        stopped; errors are logged and the loop goes on (a locked or unreachable database passes)."""
        gap = min(WAKE_GAP_S, self.settings.scheduler_s)
        last_woken = -gap
        while not self.stop_event.is_set():
            try:
                self.tick()
            except Exception:  # noqa: BLE001 - keep scheduling
                log.exception("scheduler tick failed")
            if self.wake_event.wait(self.settings.scheduler_s):
                # woken: the submits of the next `gap` seconds are placed by one tick. The gap runs
                # from the last woken tick only: a submit just after a timed tick is placed at once
                # (counting that tick cost a lone submit up to `gap` of latency, 0.25 s in bench.peer)
                self.stop_event.wait(max(0.0, last_woken + gap - time.monotonic()))
                last_woken = time.monotonic()
            self.wake_event.clear()
        try:
            with session_for(self.settings.database_url) as session:
                dbs.release_lock(session, holder=self.holder)
        except Exception:  # noqa: BLE001 - the lock lapses by itself
            log.warning("could not release the scheduler lock")

    def start(self) -> Scheduler:
        self.thread = threading.Thread(target=self.run, daemon=True, name="scheduler")
        self.thread.start()
        return self

    def stop(self, timeout_s: float = 10.0) -> None:
        self.stop_event.set()
        self.wake_event.set()
        if self.thread is not None:
            self.thread.join(timeout_s)


__all__ = ["REASONS_MARGIN_S", "WAKE_GAP_S", "Scheduler", "TickTimes", "collector_paused"]
