"""`shardyard healthcheck`: the container image's HEALTHCHECK, for whichever process the container
runs (its PID 1's command line says which), exit code 0 when healthy.

- the API (`shardyard serve`): GET /api/health answers 200 and its database is reachable (a
  deployment with no live worker is degraded, not an unhealthy API: workers start after it);
- a worker (`shardyard worker`, which becomes `celery ... worker`): a worker on this host wrote
  its heartbeat within worker_alive_s (a stuck or dead worker stops beating);
- the scheduler (`shardyard scheduler`): the database answers and the scheduler lock is held by
  someone (this one, or a standby's leader whose lease is current).
"""

from __future__ import annotations

import socket
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING

import httpx

if TYPE_CHECKING:
    from core.settings import Settings


class Unhealthy(Exception):
    pass


def pid1_argv(proc: Path = Path("/proc/1/cmdline")) -> list[str]:
    return [a for a in proc.read_bytes().decode(errors="replace").split("\0") if a]


def role_of(argv: list[str]) -> str:
    """api, worker or scheduler, from a command line."""
    # by words: Celery's main process retitles itself ("[celery] -active- (-A ... worker ...)"),
    # which leaves one argument with spaces in it
    words = " ".join(argv).split()
    if "serve" in words:
        return "api"
    if "worker" in words:
        return "worker"
    if "scheduler" in words:
        return "scheduler"
    raise Unhealthy(f"cannot tell which Shardyard process this is: {' '.join(argv)[:200]}")


def _port(argv: list[str]) -> int:
    for flag, value in zip(argv, argv[1:], strict=False):
        if flag == "--port":
            return int(value)
    return 8000


def check_api(*, port: int) -> str:
    try:
        resp = httpx.get(f"http://127.0.0.1:{port}/api/health", timeout=5)
    except httpx.TransportError as e:
        raise Unhealthy(f"the API on port {port} does not answer: {e or type(e).__name__}") from e
    if resp.status_code != 200:
        raise Unhealthy(f"GET /api/health: {resp.status_code}")
    body = resp.json()
    if not body["db"]["ok"]:
        raise Unhealthy(f"the API cannot reach its database: {body['db'].get('error')}")
    return f"api {body['status']}"


# the database checks import SQLAlchemy and the models only when they run: the API's check, every
# few seconds beside a busy API, needs no more than httpx


def check_worker(settings: Settings, *, hostname: str) -> str:
    from db.connection import session_for
    from db.jobs import aware
    from db.workers import live_workers

    with session_for(settings.database_url) as s:
        mine = [w for w in live_workers(s, within_s=settings.worker_alive_s) if w.hostname == hostname]
    if not mine:
        raise Unhealthy(
            f"no heartbeat from a worker on {hostname} in the last {settings.worker_alive_s:.0f}s"
        )
    return f"worker {mine[0].name} beat at {aware(mine[0].last_seen):%H:%M:%S}"


def check_scheduler(settings: Settings) -> str:
    from sqlalchemy import select, text

    from db.connection import session_for
    from db.jobs import aware, db_now
    from db.models import SchedulerLock
    from db.scheduling import LOCK

    with session_for(settings.database_url) as s:
        s.execute(text("SELECT 1"))
        now = db_now(s)
        lock = s.scalar(select(SchedulerLock).where(SchedulerLock.name == LOCK))
    # a scheduler that just started may not have ticked yet: give it a few of its ticks
    if lock is None or lock.holder is None or aware(lock.lease_until) + timedelta(seconds=30) < aware(now):
        raise Unhealthy("no scheduler holds the scheduler lock")
    return f"scheduler lock held by {lock.holder}"


def healthcheck(argv: list[str] | None = None) -> str:
    """A line saying what is healthy; Unhealthy with the reason otherwise."""
    argv = pid1_argv() if argv is None else argv
    role = role_of(argv)
    if role == "api":
        return check_api(port=_port(argv))
    from sqlalchemy.exc import SQLAlchemyError

    from core.settings import get_settings

    try:
        if role == "worker":
            return check_worker(get_settings(), hostname=socket.gethostname())
        return check_scheduler(get_settings())
    except SQLAlchemyError as e:
        raise Unhealthy(f"the database does not answer: {type(e).__name__}: {str(e).splitlines()[0]}") from e
