"""Celery tasks: thin wrappers that pass ids to the plain functions in workers/execute.py and
workers/selection.py, plus the worker heartbeat, the reconciler, and warm shutdown."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

from billiard.exceptions import WorkerLostError
from celery.signals import (
    celeryd_after_setup,
    worker_init,
    worker_process_init,
    worker_ready,
    worker_shutdown,
    worker_shutting_down,
)
from celery.utils.sysinfo import cpu_budget
from celery.worker import state as worker_state
from celery.worker.request import Request
from sqlalchemy.exc import OperationalError

from core.broker import TASK_RUN_JOB, TASK_RUN_SELECTION, node_queue
from core.settings import Settings, get_settings
from db.connection import session_for
from db.gangs import expire_gangs
from db.ingest import add_event
from db.jobs import db_now, expire_leases
from db.scheduling import order_lost, unclaimed_orders
from db.selections import settle_selection, sync_trials, unsettled_selections
from db.workers import mark_draining, record_heartbeat
from jobrules.restarts import max_restarts
from workers import cores, lost, spare
from workers.celery_app import app
from workers.devices import host_inventory, local_devices
from workers.execute import execute_job
from workers.gang import execute_gang_node
from workers.intake import Intake
from workers.sandbox import describe as describe_sandbox
from workers.search import grow
from workers.selection import execute_selection
from workers.supervise import DRAIN
from workers.warm import prestart

log = logging.getLogger(__name__)
_WORKER_NAME = {"name": f"worker@{socket.gethostname()}"}
_DRAINING = threading.Event()
"""Set in the main process at a warm shutdown: the heartbeat reports the worker draining."""
_BUSY = threading.Event()
"""Set while this pool process runs a task (SIGTERM then drains instead of exiting)."""


# Only infrastructure errors (database locked or unreachable, broker down) are retried, with
# backoff; a bad spec, NaN loss or OOM ends the job `failed` inside the plain functions. A retry
# re-claims the job (the lease is this process's own), it never skips it.
RETRY_INFRA = {
    "autoretry_for": (OperationalError, ConnectionError),
    "retry_backoff": True,
    "retry_backoff_max": 60,
    "max_retries": 5,
}


class LostAwareRequest(Request):
    """A task's request in the worker's main process. When the pool process running it dies (a
    kill -9, the OOM killer), billiard fails it with WorkerLostError ("signal 9 (SIGKILL)") and
    Celery gives the message back (task_reject_on_worker_lost); first, the cause is recorded beside
    every attempt that process held, for whoever takes their leases back to say
    (workers/lost.py)."""

    def on_failure(self, exc_info, send_failed_event=True, return_ok=False):  # type: ignore[no-untyped-def]  # noqa: ANN001, ANN201 - Celery's signature
        exc = getattr(exc_info, "exception", None)
        exc = getattr(exc, "exc", exc)  # billiard's ExceptionWithTraceback
        if isinstance(exc, WorkerLostError) and self.worker_pid:
            cause = lost.process_death(str(exc))
            lost.record(
                get_settings(), worker=self.hostname, owner=lost.owner_prefix(self.worker_pid), cause=cause
            )
        return super().on_failure(exc_info, send_failed_event=send_failed_event, return_ok=return_ok)


@contextlib.contextmanager
def _busy(worker: str) -> Iterator[None]:
    """This pool process runs a task: SIGTERM drains it; a full disk that ends it is recorded as
    the cause of the attempts it held (their leases then run out)."""
    _guard_sigterm()
    _BUSY.set()
    try:
        yield
    except Exception as e:
        if cause := lost.disk_full(e):
            lost.record(get_settings(), worker=worker, owner=lost.owner_prefix(os.getpid()), cause=cause)
        raise
    finally:
        _BUSY.clear()


@app.task(name=TASK_RUN_JOB, bind=True, Request=LostAwareRequest, **RETRY_INFRA)
def run_job(self, job_id: int, node_rank: int = 0, nnodes: int = 1) -> str:  # noqa: ANN001 - Celery's bound task
    """One job, end to end (workers/execute.py); with nnodes > 1, node `node_rank` of a gang
    (workers/gang.py)."""
    name = self.request.hostname or _WORKER_NAME["name"]
    with _busy(name):
        if nnodes > 1:
            return execute_gang_node(
                job_id, node_rank=node_rank, nnodes=nnodes, settings=get_settings(), worker=name
            )
        return execute_job(job_id, settings=get_settings(), worker=name)


@app.task(name=TASK_RUN_SELECTION, bind=True, Request=LostAwareRequest, **RETRY_INFRA)
def run_selection(self, selection_id: int, trial_ids: list[int], reservation_id: int | None = None) -> str:  # noqa: ANN001 - Celery's bound task
    """One group of a selection batch on this worker's devices (shard alternation), placed here by
    the scheduler (reservation `reservation_id`)."""
    name = self.request.hostname or _WORKER_NAME["name"]
    with _busy(name):
        return execute_selection(
            selection_id, trial_ids, settings=get_settings(), worker=name, reservation_id=reservation_id
        )


def reconcile_once() -> int:
    """Take back every running job and trial whose lease ran out (by database time): a cancel
    that was asked ends it `cancelled`, the rest go back to `queued` (their reservations freed,
    for the scheduler to place again). Settle every open batch from its trials. Jobs and
    selection groups are sent by the scheduler alone (core/scheduler.py; it also re-sends a lost
    message). Returns how many leases were taken back."""
    settings = get_settings()
    with session_for(settings.database_url) as s:
        # a gang goes back whole (every node's reservation) before the sweep of one-node leases,
        # both by the database's one clock
        now = db_now(s)
        requeued, cancelled = expire_gangs(s, now=now, gang_restarts=settings.gang_restarts)
        more = expire_leases(s, now=now, max_restarts=max_restarts)
        requeued, cancelled = requeued + more[0], cancelled + more[1]
        for job in requeued + cancelled:
            log.warning("job %s: the lease of %s ran out; %s", job.id, job.worker, job.status)
        touched = sync_trials(s, job_ids=[j.id for j in requeued + cancelled if j.kind == "trial"])
        s.commit()  # grow writes in its own session
        for selection_id in touched | set(unsettled_selections(s)):
            # a sampler batch whose worker died before asking its next generation asks it here
            grow(settings, selection_id=selection_id)
            settle_selection(s, selection_id=selection_id)
    return len(requeued) + len(cancelled)


def _beat(
    stop: threading.Event, name: str, queues: list[str], tasks: int = 1, intake: Intake | None = None
) -> None:
    settings = get_settings()
    devices = local_devices()
    host = host_inventory(slots=settings.worker_slots, tasks=tasks)
    sandbox_state = describe_sandbox(settings)  # probed once: bwrap's rights do not change
    last_reconcile = 0.0
    while True:
        try:
            with session_for(settings.database_url) as s:
                inventory = {**host, "draining": 1} if _DRAINING.is_set() else host
                record_heartbeat(
                    s,
                    name=name,
                    hostname=socket.gethostname(),
                    queues=queues,
                    devices=devices,
                    host=inventory,
                    sandbox=sandbox_state,
                )
            if intake is not None and intake.free:
                try:
                    resend_lost(settings, name=name, intake=intake)
                except Exception:  # noqa: BLE001 - the reconciler still runs; asked again next beat
                    log.exception("could not ask for lost orders again")
            if time.monotonic() - last_reconcile > settings.reconcile_s:
                last_reconcile = time.monotonic()
                if n := reconcile_once():
                    log.warning("took back %d job(s) and trial(s) whose lease ran out", n)
        except Exception:  # noqa: BLE001 - keep beating
            log.exception("heartbeat failed")
        if stop.wait(settings.heartbeat_s):
            return


def resend_lost(settings: Settings, *, name: str, intake: Intake) -> list[int]:
    """The orders placed on this worker that it could have taken for intake.grace_s and never got
    are marked unsent: the scheduler's next tick sends them again (workers/intake.py). Returns
    their jobs."""
    asked = []
    with session_for(settings.database_url) as s:
        for order in intake.lost(unclaimed_orders(s, worker=name)):
            if not order_lost(s, order=order):
                continue  # claimed or sent again meanwhile
            asked.append(order.job_id)
            times = intake.times_asked(order.reservation_id)
            why = f"its order never reached {name}, free to take it for {intake.grace_s:g} s: sent again"
            log.warning("job %s: %s (time %d)", order.job_id, why, times)
            if times == 1:  # the job's log says it once, not at each ask after
                add_event(s, job_id=order.job_id, kind="log", message=why)
    return asked


_stop_beat = threading.Event()
_controller: dict[str, Any] = {}


@celeryd_after_setup.connect
def _consume_node_queue(sender: str = "", instance=None, **_kwargs) -> None:  # noqa: ANN001 - Celery signal
    """Every worker also consumes its own direct queue (node.<name>): the scheduler sends a job
    there after reserving this worker's slots."""
    if instance is not None and sender:
        instance.app.amqp.queues.select_add(node_queue(sender))


@worker_init.connect
def _share_cores(sender=None, **_kwargs) -> None:  # noqa: ANN001 - Celery signal
    # before the pool processes are forked: each run gets the worker's CPU budget over
    # --concurrency (workers/cores.py). Celery resolves "auto" after this signal, to the prefork
    # pool's CPU budget: the same number here
    budget = cpu_budget(use_cgroup_quota=True).count
    concurrency = getattr(sender, "concurrency", None)
    if not isinstance(concurrency, int):
        concurrency = budget
    cores.set_tasks(concurrency, cores=budget)


@worker_ready.connect
def _start_heartbeat(sender=None, **_kwargs) -> None:  # noqa: ANN001 - Celery signal
    _controller["worker"] = sender
    name = getattr(sender, "hostname", None) or _WORKER_NAME["name"]
    queues = sorted(q.name for q in sender.app.amqp.queues.consume_from.values()) if sender else ["cpu"]
    # worker_ready's sender is the worker's Consumer: its WorkController holds --concurrency (the
    # Consumer has none, and every worker advertised one task: bench.api_load --jobs 10 ran one)
    controller = getattr(sender, "controller", None)
    tasks = int(getattr(controller, "concurrency", None) or getattr(sender, "concurrency", 1) or 1)
    # worker_ready comes once the consumer consumes: a worker still starting samples nothing, so
    # it never asks for an order again (workers/intake.py)
    intake = Intake(grace_s=get_settings().lost_order_s)
    threading.Thread(
        target=_beat, args=(_stop_beat, name, queues, tasks, intake), daemon=True, name="heartbeat"
    ).start()
    threading.Thread(
        target=_watch_pool, args=(_stop_beat, name, tasks, intake), daemon=True, name="pool-watch"
    ).start()


POOL_WATCH_S = 0.2


def _watch_pool(stop: threading.Event, name: str, tasks: int = 1, intake: Intake | None = None) -> None:
    """In the main process: a pool process that died (a kill -9, the OOM killer) is seen here as
    a zombie before billiard reaps it (which can take its pool's next maintenance, seconds), and
    the cause is recorded beside the attempts it held, well before their leases run out. Each
    pass also tells `intake` whether this worker could take a task now."""
    settings = get_settings()
    seen: set[int] = set()
    while not stop.wait(POOL_WATCH_S):
        consumer = _controller.get("worker")
        pool = getattr(consumer, "pool", None)
        try:
            pids = set(pool.info.get("processes", [])) if pool is not None else set()
        except Exception:  # noqa: BLE001 - no pool (solo), or one being restarted
            if intake is not None:
                intake.sample(False)
            continue
        seen &= pids
        for pid in pids - seen:
            if (status := lost.zombie_status(pid)) is not None:
                seen.add(pid)
                lost.record(
                    settings, worker=name, owner=lost.owner_prefix(pid), cause=lost.death_cause(status)
                )
        if intake is not None:
            intake.sample(can_take(consumer, tasks=tasks, processes=len(pids - seen)))


def can_take(consumer: Any, *, tasks: int, processes: int) -> bool:
    """This worker would fetch an order from its queue now: not draining, its consumer connected
    to the broker (Celery clears `connection` from a failure until it is connected again), all
    its pool processes up, and fewer tasks held (received, running, or waiting for a process)
    than it has processes."""
    return (
        not _DRAINING.is_set()
        and getattr(consumer, "connection", None) is not None
        and processes >= tasks
        and len(worker_state.reserved_requests) < tasks
    )


@worker_process_init.connect
def _start_warm_trainer(**_kwargs) -> None:
    # this pool process's warm start imports torch now, so its first run is warm too: a spare
    # sandboxed trainer where runs are sandboxed (workers/spare.py), else the zygote
    if not spare.prestart(get_settings()):
        prestart()


@worker_shutdown.connect
def _stop_heartbeat(**_kwargs) -> None:
    _stop_beat.set()


# ---- warm shutdown ----------------------------------------------------------------------------
# Celery's warm shutdown (SIGTERM to the main process) waits for running tasks to end. We make
# them end soon: the main process passes SIGTERM on to its pool processes; a pool process running
# a task sets DRAIN, its trainer is asked to stop and checkpoint (killed after shutdown_grace_s),
# and the job goes back to `queued` (or ends `cancelled` if that was asked) for the scheduler to
# place again (this worker is marked draining, so elsewhere or after its restart), to resume from
# the checkpoint. An idle pool process just exits.


_pool_sigterm: dict[str, Any] = {}


def _on_sigterm(signum: int, frame: Any) -> None:
    if _BUSY.is_set():
        DRAIN.set()
        return
    before = _pool_sigterm.get("before")
    if callable(before):
        before(signum, frame)  # billiard's own: leave the pool process
        return
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGTERM)


def _guard_sigterm() -> None:
    """In the pool process, at its first task (billiard sets its own SIGTERM handler after
    Celery's worker_process_init, so this cannot go there): SIGTERM drains the running task."""
    if "before" not in _pool_sigterm and threading.current_thread() is threading.main_thread():
        _pool_sigterm["before"] = signal.getsignal(signal.SIGTERM)
        signal.signal(signal.SIGTERM, _on_sigterm)


@worker_shutting_down.connect
def _drain_pool(sig: str = "", how: str = "", **_kwargs) -> None:  # noqa: ANN003 - Celery signal
    if how != "Warm":
        return  # a cold shutdown kills the trainers with their pool processes; leases run out
    worker = _controller.get("worker")
    _DRAINING.set()
    try:  # the scheduler places nothing more here (the jobs given back go to other workers)
        with session_for(get_settings().database_url) as s:
            mark_draining(s, name=getattr(worker, "hostname", None) or _WORKER_NAME["name"])
    except Exception:  # noqa: BLE001 - the heartbeat then just stops
        log.warning("could not mark this worker draining")
    pool = getattr(worker, "pool", None)
    try:
        pids = list(pool.info.get("processes", [])) if pool is not None else []
    except Exception:  # noqa: BLE001 - no pool (solo): DRAIN here
        pids = []
    if not pids:
        DRAIN.set()
    for pid in pids:
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
