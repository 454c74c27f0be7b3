"""Names shared by the API and the workers, and the API's side of the broker: it sends Celery
tasks by name (never importing the worker code) and reads the per-job Redis channels.

The broker carries wake-ups, not truth: anything that can reach Redis can publish on a job's
channel (a leaked password, a job's own code on a worker), so what the service's own processes
publish is signed (`sign_live`, HMAC-SHA256 with SHARDYARD_BROKER_SIGNING_KEY over the channel,
a timestamp and the body) and the API shows a message's content only once `open_live` verified
it. Without a key nothing is signed and every message is only a cue to read the database.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import time

import redis
from celery import Celery

from core.settings import Settings

SIGNED_PREFIX = b"s1."
"""A signed live message: `s1.<unix seconds>.<64 hex digits of HMAC-SHA256>.<JSON body>`."""
SIGNED_MAX_AGE_S = 300.0
"""A signed message older (or newer, by the clocks of two hosts) than this is refused: a copy of
a real message re-published later on the same channel (someone who can subscribe to it) shows
nothing stale, while hosts whose clocks are a few minutes apart still agree."""
_MAC_HEX = 64

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


def broker_signing_key(settings: Settings) -> bytes | None:
    """The key live messages are signed and verified with; None when the deployment has none."""
    key = settings.broker_signing_key
    if key is None or not key.get_secret_value():
        return None
    return key.get_secret_value().encode()


def _mac(key: bytes, *, channel: str, stamp: bytes, body: bytes) -> str:
    # the channel is under the MAC: a real message of one job, copied onto another job's channel
    # by someone who can read the first, does not verify there (its length first: no channel and
    # body can be cut apart differently into the same bytes)
    name = channel.encode()
    msg = b"%d:%s\n%s\n%s" % (len(name), name, stamp, body)
    return hmac.new(key, msg, hashlib.sha256).hexdigest()


def sign_live(key: bytes, *, channel: str, body: bytes, now: float | None = None) -> bytes:
    """`body` (a JSON document) as published on `channel`, signed with `key`."""
    stamp = b"%d" % int(time.time() if now is None else now)
    mac = _mac(key, channel=channel, stamp=stamp, body=body).encode()
    return b"%s%s.%s.%s" % (SIGNED_PREFIX, stamp, mac, body)


def split_live(payload: bytes) -> tuple[bytes, bytes, bytes] | None:
    """(stamp, mac, body) of a signed payload; None for one that is not in the signed form."""
    if not payload.startswith(SIGNED_PREFIX):
        return None
    stamp, _, rest = payload[len(SIGNED_PREFIX) :].partition(b".")
    mac, body = rest[:_MAC_HEX], rest[_MAC_HEX + 1 :]
    if not stamp.isdigit() or len(mac) != _MAC_HEX or rest[_MAC_HEX : _MAC_HEX + 1] != b".":
        return None
    return stamp, mac, body


def open_live(key: bytes, *, channel: str, payload: bytes, now: float | None = None) -> bytes | None:
    """The body of a payload signed with `key` for `channel` within SIGNED_MAX_AGE_S of `now`;
    None for anything else (unsigned, another key, another channel, too old, altered)."""
    parts = split_live(payload)
    if parts is None:
        return None
    stamp, mac, body = parts
    if abs((time.time() if now is None else now) - int(stamp)) > SIGNED_MAX_AGE_S:
        return None
    want = _mac(key, channel=channel, stamp=stamp, body=body).encode()
    return body if hmac.compare_digest(want, mac) else None


def transport_options(settings: Settings) -> dict[str, int]:
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
