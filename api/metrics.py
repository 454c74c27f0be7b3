"""GET /metrics for Prometheus (admins only), and the request-latency middleware.

Two kinds of series, from two places:
- the fleet (jobs, trials and batches by status, the queue, live workers, their slots and devices,
  the webhook outbox) is read from the database at scrape time by `FleetCollector`: a few grouped
  counts, so every API process answers the same whichever one Prometheus reaches;
- per-process instruments (request latency, open streams, the connection pool, the scheduler's
  tick and decision time, webhook attempts) live in core/telemetry.py and are summed over the
  processes by prometheus-client's multiprocess mode when PROMETHEUS_MULTIPROC_DIR is set.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

from fastapi import APIRouter, Response
from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from sqlalchemy import func, select
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from api.auth import AdminUser
from api.deps import SettingsDep
from api.stalls import StallWatch
from core.exposition import MultiprocessText
from core.multiproc import MULTIPROC_ENV
from core.settings import Settings
from core.telemetry import DB_POOL_IN_USE, DB_POOL_SIZE, HTTP_LATENCY, multiprocess
from db import webhooks as dbw
from db.connection import get_engine, session_for
from db.jobs import aware, db_now
from db.models import Job, JobStatus, Reservation, Selection, Trial
from db.scheduling import workers_seen

router = APIRouter(tags=["metrics"])


def _route_of(scope: Scope) -> str:
    """The matched route's template (`/api/jobs/{job_id}`), never the raw path: one series per
    route, not per job id. A path no route matched counts as `unmatched`."""
    route = scope.get("route")
    path = getattr(route, "path", None)
    if path is None:
        return "unmatched"
    return path or "/"


class LatencyMiddleware:
    """Times each HTTP request to its response's start (a stream is timed to its headers: how long
    it stays open is the open-streams gauge's business)."""

    def __init__(self, app: ASGIApp, *, database_url: str, stalls: StallWatch | None = None) -> None:
        self.app = app
        self.database_url = database_url
        self.stalls = stalls

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        status = {"code": 500}
        observed = False
        watched = None if self.stalls is None else self.stalls.begin(f"{scope['method']} {scope['path']}")

        def observe(code: int) -> None:
            nonlocal observed
            if not observed:
                observed = True
                if watched is not None:
                    self.stalls.end(watched)  # type: ignore[union-attr]
                HTTP_LATENCY.labels(scope["method"], _route_of(scope), str(code)).observe(
                    time.perf_counter() - started
                )

        async def timed_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
                observe(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, timed_send)
        finally:
            observe(status["code"])  # an exception before any response: counted as its 500
            sample_pool(self.database_url)


def sample_pool(database_url: str) -> None:
    pool = get_engine(database_url).pool
    if hasattr(pool, "checkedout"):
        DB_POOL_IN_USE.set(pool.checkedout())
        DB_POOL_SIZE.set(pool.size())


ENDED = (JobStatus.succeeded, JobStatus.failed, JobStatus.cancelled)


def _gauge(name: str, doc: str, labels: list[str], rows: Iterable[Sequence[Any]] = ()) -> GaugeMetricFamily:
    """A gauge with a sample for each of `rows`: its label values, then its value."""
    gauge = GaugeMetricFamily(name, doc, labels=labels)
    for *values, n in rows:
        gauge.add_metric(values, n)
    return gauge


class FleetCollector(Collector):
    """The fleet's state from the database, read at each scrape."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings

    def collect(self) -> Iterator[Metric]:
        s = self.settings
        with session_for(s.database_url) as session:
            now = db_now(session)
            yield _gauge(
                "shardyard_jobs",
                "Jobs by kind (job, trial) and status",
                ["kind", "status"],
                session.execute(select(Job.kind, Job.status, func.count()).group_by(Job.kind, Job.status)),
            )
            yield _gauge(
                "shardyard_trials",
                "Trials of batches by status",
                ["status"],
                session.execute(select(Trial.status, func.count()).group_by(Trial.status)),
            )
            yield _gauge(
                "shardyard_selections",
                "Model-selection batches by status",
                ["status"],
                session.execute(select(Selection.status, func.count()).group_by(Selection.status)),
            )

            depth = _gauge("shardyard_queue_depth", "Jobs waiting (queued), by queue", ["queue"])
            oldest = _gauge(
                "shardyard_queue_oldest_wait_seconds",
                "How long the longest-waiting queued job has waited, by queue",
                ["queue"],
            )
            waited = func.min(func.coalesce(Job.enqueued_at, Job.created_at))
            for queue, n, first in session.execute(
                select(Job.queue, func.count(), waited)
                .where(Job.status == JobStatus.queued)
                .group_by(Job.queue)
            ):
                depth.add_metric([queue], n)
                if first is not None:
                    oldest.add_metric([queue], max(0.0, (now - aware(first)).total_seconds()))  # type: ignore[operator]
            yield depth
            yield oldest

            beats = workers_seen(session, within_s=s.worker_alive_s)
            used = {
                w: (int(sl or 0), int(g or 0))
                for w, sl, g in session.execute(
                    select(
                        Reservation.worker, func.sum(Reservation.slots), func.sum(Reservation.gpus)
                    ).group_by(Reservation.worker)
                )
            }
            yield GaugeMetricFamily(
                "shardyard_workers_live", "Workers whose heartbeat is recent", value=len(beats)
            )
            slots = _gauge("shardyard_worker_slots", "Rank slots a live worker offers", ["worker"])
            reserved = _gauge(
                "shardyard_worker_slots_reserved", "Rank slots reserved on a live worker now", ["worker"]
            )
            devices = _gauge(
                "shardyard_worker_devices", "Devices a live worker reports, by type", ["worker", "type"]
            )
            draining = _gauge(
                "shardyard_worker_draining", "1 while a live worker is shutting down", ["worker"]
            )
            for b in beats:
                host = (b.devices or {}).get("host") or {}
                slots.add_metric([b.name], int(host.get("slots") or 0))
                reserved.add_metric([b.name], used.get(b.name, (0, 0))[0])
                draining.add_metric([b.name], 1 if host.get("draining") else 0)
                kinds: dict[str, int] = {}
                for d in (b.devices or {}).get("devices", []):
                    kinds[str(d.get("type", "unknown"))] = kinds.get(str(d.get("type", "unknown")), 0) + 1
                for kind, n in kinds.items():
                    devices.add_metric([b.name, kind], n)
            yield from (slots, reserved, devices, draining)

            yield _gauge(
                "shardyard_webhook_deliveries",
                "Webhook deliveries by state",
                ["state"],
                dbw.outbox_counts(session).items(),
            )


@router.get("/metrics", include_in_schema=False)
def metrics(settings: SettingsDep, _admin: AdminUser) -> Response:
    """Prometheus text exposition. Admins only: it names workers and counts every user's jobs."""
    sample_pool(settings.database_url)
    # one process: its own instruments are in the default registry
    own = _multiprocess_text() if multiprocess() else generate_latest(REGISTRY)
    fleet = CollectorRegistry()
    fleet.register(FleetCollector(settings))
    return Response(own + generate_latest(fleet), media_type=CONTENT_TYPE_LATEST)


_TEXTS: dict[str, MultiprocessText] = {}


def _multiprocess_text() -> bytes:
    """Every process's instruments summed, read afresh at each scrape; what does not change
    between scrapes (each series' parsed key and label text) is kept per folder
    (core/exposition.py)."""
    path = os.environ[MULTIPROC_ENV]
    text = _TEXTS.get(path)
    if text is None:
        text = _TEXTS.setdefault(path, MultiprocessText(path))
    return text.render()
