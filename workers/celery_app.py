"""The Celery app of the workers. Run with:

celery -A workers.celery_app worker -Q cpu,gpu --concurrency 1
"""

from __future__ import annotations

from celery import Celery
from kombu import Queue

from core.broker import QUEUES, TASK_RUN_JOB, TASK_RUN_SELECTION, transport_options
from core.settings import get_settings

settings = get_settings()

app = Celery("shardyard", broker=settings.broker_url, include=["workers.tasks"])
app.conf.update(
    task_queues=[Queue(q) for q in QUEUES],
    task_default_queue="cpu",
    task_create_missing_queues=False,
    task_routes={TASK_RUN_JOB: {"queue": "cpu"}, TASK_RUN_SELECTION: {"queue": "cpu"}},
    # ack after the task ran, one message at a time, and give the message back if the worker
    # process dies: with the idempotent claim this gives at-least-once delivery, run-once jobs
    task_acks_late=True,
    task_reject_on_worker_lost=True,
    worker_prefetch_multiplier=1,
    broker_transport_options=transport_options(settings),
    broker_connection_retry_on_startup=True,
    task_ignore_result=True,
    worker_hijack_root_logger=False,
    worker_send_task_events=False,
)
