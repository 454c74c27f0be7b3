"""Celery tasks: thin wrappers that pass ids to the plain functions in workers/execute.py, plus the
worker heartbeat and the reconciler that re-sends lost messages."""

from __future__ import annotations

import logging
import socket
import threading
import time

from celery.signals import worker_ready, worker_shutdown
from sqlalchemy.exc import OperationalError

from core.broker import TASK_RUN_JOB, TASK_RUN_SELECTION, send_run_job
from core.settings import get_settings
from db.engine import session_for
from db.jobs import (
    live_workers,
    mark_enqueued,
    orphaned_running_jobs,
    record_heartbeat,
    requeue_job,
    stale_queued_jobs,
)
from workers.celery_app import app
from workers.devices import host_inventory, local_devices
from workers.execute import execute_job
from workers.selection import execute_selection

log = logging.getLogger(__name__)
_WORKER_NAME = {"name": f"worker@{socket.gethostname()}"}


# Only infrastructure errors (database locked or unreachable, broker down) are retried, with
# backoff; a bad spec, NaN loss or OOM ends the job `failed` inside the plain functions.
RETRY_INFRA = {
    "autoretry_for": (OperationalError, ConnectionError),
    "retry_backoff": True,
    "retry_backoff_max": 60,
    "max_retries": 5,
}


@app.task(name=TASK_RUN_JOB, bind=True, **RETRY_INFRA)
def run_job(self, job_id: int) -> str:  # noqa: ANN001 - Celery's bound task
    """One job, end to end (workers/execute.py)."""
    name = self.request.hostname or _WORKER_NAME["name"]
    return execute_job(job_id, settings=get_settings(), worker=name)


def reconcile_once() -> int:
    """Put back in the queue every running job whose worker is gone, and re-send the message of
    every job queued for too long; the idempotent claim makes a duplicate harmless. The trainer
    resumes from the job's latest checkpoint. Returns how many were sent."""
    settings = get_settings()
    with session_for(settings.database_url) as s:
        alive = {w.name for w in live_workers(s, within_s=settings.orphan_after_s)}
        orphans = orphaned_running_jobs(s, alive=alive) if alive else []
        for job in orphans:
            requeue_job(s, job_id=job.id, reason=f"worker {job.worker} stopped sending heartbeats")
        stale = stale_queued_jobs(s, older_than_s=settings.requeue_after_s)
        resend = {j.id: j for j in [*orphans, *stale]}
        for job in resend.values():
            send_run_job(settings, job_id=job.id, queue=job.queue)
        mark_enqueued(s, job_ids=list(resend))
    return len(resend)


def _beat(stop: threading.Event, name: str, queues: list[str]) -> None:
    settings = get_settings()
    devices = local_devices()
    host = host_inventory(slots=settings.worker_slots)
    last_reconcile = 0.0
    while True:
        try:
            with session_for(settings.database_url) as s:
                record_heartbeat(
                    s, name=name, hostname=socket.gethostname(), queues=queues, devices=devices, host=host
                )
            if time.monotonic() - last_reconcile > settings.reconcile_s:
                last_reconcile = time.monotonic()
                if n := reconcile_once():
                    log.warning("re-sent %d job(s): lost message or dead worker", n)
        except Exception:  # noqa: BLE001 - keep beating
            log.exception("heartbeat failed")
        if stop.wait(settings.heartbeat_s):
            return


_stop_beat = threading.Event()


@worker_ready.connect
def _start_heartbeat(sender=None, **_kwargs) -> None:  # noqa: ANN001 - Celery signal
    name = getattr(sender, "hostname", None) or _WORKER_NAME["name"]
    queues = sorted(q.name for q in sender.app.amqp.queues.consume_from.values()) if sender else ["cpu"]
    threading.Thread(target=_beat, args=(_stop_beat, name, queues), daemon=True, name="heartbeat").start()


@worker_shutdown.connect
def _stop_heartbeat(**_kwargs) -> None:
    _stop_beat.set()


@app.task(name=TASK_RUN_SELECTION, bind=True, **RETRY_INFRA)
def run_selection(self, selection_id: int, trial_ids: list[int]) -> str:  # noqa: ANN001 - Celery's bound task
    """One group of a selection batch on this worker's devices (shard alternation)."""
    name = self.request.hostname or _WORKER_NAME["name"]
    return execute_selection(selection_id, trial_ids, settings=get_settings(), worker=name)
