"""Names shared by the API and the workers, and the API's side of the broker: it sends Celery
tasks by name (never importing the worker code) and reads the per-job Redis channels."""

from __future__ import annotations

import functools

import redis
from celery import Celery

from core.settings import Settings

TASK_RUN_JOB = "shardyard.run_job"
TASK_RUN_SELECTION = "shardyard.run_selection"
QUEUES = ("gpu", "cpu")
JOBS_CHANNEL = "shardyard:jobs"
"""Every job status change (data: {"job_id", "status"}), for the dashboard's live jobs table."""


NODE_QUEUE_PREFIX = "node."


def node_queue(worker_name: str) -> str:
    """The direct queue of one worker (its Celery node name, e.g. worker1@host): the scheduler
    sends a job's task there once it reserved that worker's slots."""
    return NODE_QUEUE_PREFIX + worker_name


def job_channel(job_id: int) -> str:
    return f"shardyard:job:{job_id}"


def selection_channel(selection_id: int) -> str:
    return f"shardyard:selection:{selection_id}"


def transport_options(settings: Settings) -> dict[str, object]:
    # the visibility timeout must outlast the longest job, or Redis re-delivers a running job's
    # unacknowledged message to another worker
    return {"visibility_timeout": settings.max_job_runtime_s + 3600}


SEND_TIMEOUT_S = 5.0
"""Longest wait for an answer from Redis when sending or publishing."""


@functools.cache
def celery_client(broker_url: str, visibility_timeout: int) -> Celery:
    app = Celery("shardyard-api", broker=broker_url)
    # bounded waits: a broker that is down or hung (accepts, never answers) fails a send within
    # seconds instead of hanging the request; the job stays queued and is sent again later
    app.conf.broker_transport_options = {
        "visibility_timeout": visibility_timeout,
        "socket_timeout": SEND_TIMEOUT_S,
        "socket_connect_timeout": 2,
    }
    app.conf.broker_connection_timeout = 2
    app.conf.task_publish_retry_policy = {
        "max_retries": 1,
        "interval_start": 0,
        "interval_step": 0.5,
        "interval_max": 0.5,
    }
    app.conf.broker_connection_retry_on_startup = True
    return app


def send_run_job(settings: Settings, *, job_id: int, queue: str, node_rank: int = 0, nnodes: int = 1) -> None:
    """One node's task of a placed job (the scheduler sends it to the worker's node_queue)."""
    app = celery_client(settings.broker_url, int(transport_options(settings)["visibility_timeout"]))
    kwargs = {"node_rank": node_rank, "nnodes": nnodes}
    app.send_task(TASK_RUN_JOB, args=[job_id], kwargs=kwargs, queue=queue)


def send_run_selection(
    settings: Settings, *, selection_id: int, trial_ids: list[int], queue: str, reservation_id: int
) -> None:
    """One group of a selection batch, placed by the scheduler: reservation `reservation_id` holds
    the group's slots on the worker whose node_queue `queue` is."""
    app = celery_client(settings.broker_url, int(transport_options(settings)["visibility_timeout"]))
    kwargs = {"reservation_id": reservation_id}
    app.send_task(TASK_RUN_SELECTION, args=[selection_id, trial_ids], kwargs=kwargs, queue=queue)


@functools.cache
def redis_client(url: str) -> redis.Redis:
    return redis.Redis.from_url(
        url, socket_connect_timeout=2, socket_timeout=SEND_TIMEOUT_S, health_check_interval=30
    )
