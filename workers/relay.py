"""Relays a running job's output: metric points go to the database in batches and then onto the
job's Redis channel with their row ids; log lines, status changes and trainer events are written
one by one (they are rare) and published the same way."""

from __future__ import annotations

import json
import logging
import threading
import time
from typing import Any

from core.broker import JOBS_CHANNEL, job_channel, redis_client
from core.settings import Settings
from db.engine import session_for
from db.jobs import add_event, add_metric_points

log = logging.getLogger(__name__)


class Relay:
    """Thread-safe; a background thread flushes metric batches every `flush_s` seconds."""

    def __init__(
        self,
        settings: Settings,
        *,
        job_id: int,
        extra_channels: tuple[str, ...] = (),
        flush_s: float = 0.2,
        max_batch: int = 2000,
    ) -> None:
        self.settings = settings
        self.job_id = job_id
        self.channels = (job_channel(job_id), *extra_channels)
        self._pending: list[tuple[int, str, float, float]] = []
        self._lock = threading.Lock()
        self._flush_lock = threading.Lock()
        self._max_batch = max_batch
        self._stop = threading.Event()
        self._last_progress = 0.0
        self.points_written = 0
        self._thread = threading.Thread(
            target=self._run, args=(flush_s,), daemon=True, name=f"relay-{job_id}"
        )
        self._thread.start()

    # ---- publishing --------------------------------------------------------------------------

    def publish(self, msg: dict[str, Any], *, channels: tuple[str, ...] | None = None) -> None:
        try:
            r = redis_client(self.settings.broker_url)
            payload = json.dumps(msg, separators=(",", ":"))
            for ch in channels or self.channels:
                r.publish(ch, payload)
        except Exception as e:  # noqa: BLE001 - the database has it; live delivery is best effort
            log.warning("publish failed for job %s: %s", self.job_id, e)

    def announce(self, status: str) -> None:
        """Tell the dashboard's jobs table that this job changed."""
        self.publish({"job_id": self.job_id, "status": status}, channels=(JOBS_CHANNEL,))

    # ---- metrics -----------------------------------------------------------------------------

    def metric(self, step: int, name: str, value: float, at: float) -> None:
        with self._lock:
            self._pending.append((step, name, value, at))
            full = len(self._pending) >= self._max_batch
        if full:
            self.flush()

    def flush(self) -> None:
        with self._flush_lock:
            with self._lock:
                batch, self._pending = self._pending, []
            if not batch:
                return
            with session_for(self.settings.database_url) as s:
                ids = add_metric_points(s, job_id=self.job_id, points=batch)
            self.points_written += len(ids)
            points = [
                {"id": i, "job_id": self.job_id, "step": st, "name": n, "value": v, "time": t}
                for i, (st, n, v, t) in zip(ids, batch, strict=True)
            ]
            self.publish({"type": "metrics", "points": points})
            now = time.monotonic()
            if now - self._last_progress > 1.0:  # progress bars: at most once a second
                self._last_progress = now
                self.announce("running")

    def _run(self, flush_s: float) -> None:
        while not self._stop.wait(flush_s):
            try:
                self.flush()
            except Exception:  # noqa: BLE001 - keep relaying; the next flush retries the DB
                log.exception("metric flush failed for job %s", self.job_id)

    # ---- events ------------------------------------------------------------------------------

    def event(
        self, *, kind: str, message: str, data: dict[str, Any] | None = None, at: float | None = None
    ) -> int:
        """kind: status | log | event. Metrics before a status change are flushed first, so a
        client never sees `succeeded` before the last points."""
        if kind == "status":
            self.flush()
        at = at or time.time()
        with session_for(self.settings.database_url) as s:
            eid = add_event(s, job_id=self.job_id, kind=kind, message=message, data=data, at=at)
        self.publish({"type": "event", "id": eid, "kind": kind, "message": message, "data": data, "time": at})
        if kind == "status":
            self.announce(message)
        return eid

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self.flush()
