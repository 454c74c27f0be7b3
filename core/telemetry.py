"""Prometheus instruments kept per process: counters and histograms of the API processes and of
the scheduler process. The fleet's state (jobs by status, queue, workers) is not here: api/metrics.py
reads it from the database at scrape time, the one place every process agrees on.

Several processes serve one /metrics: every uvicorn worker, and the scheduler's child process.
prometheus-client's multiprocess mode adds them up: with PROMETHEUS_MULTIPROC_DIR set (before
this module is first imported) each process writes its values to files there and the scraped
process sums them. `shardyard serve` and `shardyard stack` set it to a fresh folder under the data
dir when it is unset; without it, /metrics shows only the answering process's own instruments.
"""

from __future__ import annotations

import gc
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from core.multiproc import MULTIPROC_ENV

log = logging.getLogger(__name__)

# from a quick read to a slow request or tick under load: 1 ms .. 10 s
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)

HTTP_LATENCY = Histogram(
    "shardyard_http_request_duration_seconds",
    "Time from a request's arrival to its response's first byte (a stream's headers), by route "
    "template (never the raw path), method and status",
    ["method", "route", "status"],
    buckets=LATENCY_BUCKETS,
)
OPEN_STREAMS = Gauge(
    "shardyard_sse_open_streams",
    "Server-Sent Event streams open now, over all API processes",
    multiprocess_mode="livesum",
)
SSE_READS = Counter(
    "shardyard_sse_database_reads",
    "Reads of the database by job streams, by why: open (a stream starts or resumes), catch_up "
    "(live messages were dropped or lost, or the broker is down), look (the periodic look at a "
    "job's newest ids, one for all its streams), recheck (a stream's own read of rows that look "
    "found it may lack: a publish lost without a trace)",
    ["why"],
)
SSE_ROWS = Counter(
    "shardyard_sse_database_rows",
    "Metric points and events job streams read from the database and framed, by why (as above)",
    ["why"],
)
LIVE_REJECTED = Counter(
    "shardyard_live_messages_rejected",
    "Live messages the API dropped unshown, by why: unsigned (no signature while the API has a "
    "key), bad_signature (another key or channel, altered, or outside the age window), "
    "not_json (signed, yet not a JSON object)",
    ["why"],
)
DB_POOL_IN_USE = Gauge(
    "shardyard_db_pool_connections_in_use",
    "Database connections the API processes have checked out of their pools now",
    multiprocess_mode="livesum",
)
DB_POOL_SIZE = Gauge(
    "shardyard_db_pool_size",
    "Connections the API processes' pools keep (their sum; each may open max_overflow more)",
    multiprocess_mode="livesum",
)
SCHEDULER_TICK = Histogram(
    "shardyard_scheduler_tick_seconds",
    "One scheduler pass by the lock holder: read the state, decide, reserve, send, write wait reasons",
    buckets=LATENCY_BUCKETS,
)
SCHEDULER_PLACEMENT = Histogram(
    "shardyard_scheduler_placement_seconds",
    "A scheduler pass by the lock holder up to its placements reserved and sent (before wait reasons)",
    buckets=LATENCY_BUCKETS,
)
SCHEDULER_DECISION = Histogram(
    "shardyard_scheduler_decision_seconds",
    "The pure placement decision inside a tick (order the queue, fit jobs to workers)",
    buckets=LATENCY_BUCKETS,
)
SCHEDULER_PLACED = Counter("shardyard_scheduler_placements", "Jobs and batch groups the scheduler placed")
WEBHOOK_ATTEMPTS = Counter(
    "shardyard_webhook_attempts",
    "Webhook POSTs by result: delivered (2xx), retry (will try again), gave_up (last attempt failed)",
    ["result"],
)


GC_PAUSE = Histogram(
    "shardyard_gc_pause_seconds",
    "The API process held still by Python's garbage collector, a collection at a time, by "
    "generation (2: a full one, which walks every object made since start-up)",
    ["generation"],
    buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0),
)


_GC_PAUSES: deque[tuple[int, float]] = deque(maxlen=10_000)
"""(generation, seconds) of the collections not yet observed in GC_PAUSE."""


def time_gc(*, flush_s: float = 1.0) -> Callable[[str, dict[str, int]], None]:
    """Time every collection of this process, and observe them in GC_PAUSE from a thread of their
    own every `flush_s` (0: never; `flush_gc_pauses` then does). Not in the collector's callback:
    a collection can start inside prometheus-client's own lock (any allocation may start one, in
    whichever thread allocates), and observing from there would wait for that lock for ever.
    Returns the callback."""
    began = [0.0]

    def on_gc(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            began[0] = time.perf_counter()
        else:
            _GC_PAUSES.append((info["generation"], time.perf_counter() - began[0]))

    gc.callbacks.append(on_gc)
    if flush_s > 0:

        def flush_every() -> None:
            while True:
                time.sleep(flush_s)
                try:
                    flush_gc_pauses()
                except Exception:  # noqa: BLE001 - the metrics' files (a full disk): next time
                    log.warning("could not record the garbage collector's pauses", exc_info=True)

        threading.Thread(target=flush_every, daemon=True, name="gc-pauses").start()
    return on_gc


def flush_gc_pauses() -> int:
    """Observe the collections timed since the last flush; returns how many."""
    n = len(_GC_PAUSES)  # those there now: collections made while it observes wait for the next
    for _ in range(n):
        generation, seconds = _GC_PAUSES.popleft()
        GC_PAUSE.labels(str(generation)).observe(seconds)
    return n


def multiprocess() -> bool:
    return bool(os.environ.get(MULTIPROC_ENV))


def process_exited(pid: int | None = None) -> None:
    """Drop a stopped process's live gauges (open streams, pool) from the multiprocess sums."""
    if multiprocess():
        from prometheus_client import multiprocess as mp

        mp.mark_process_dead(pid or os.getpid())  # type: ignore[no-untyped-call]


def multiprocess_registry() -> CollectorRegistry:
    """A registry that sums every process's files in PROMETHEUS_MULTIPROC_DIR (made per scrape, as
    prometheus-client asks: the files change between scrapes)."""
    from prometheus_client import multiprocess as mp

    registry = CollectorRegistry()
    mp.MultiProcessCollector(registry)  # type: ignore[no-untyped-call]
    return registry
