"""Service benchmark on the real embedded stack (redis-server, uvicorn API, Celery worker, SQLite).

    python -m bench.service [--submits 600] [--latency-jobs 20] [--points 100000] [--sse 300]

Measures submit throughput, submit -> running latency with a warm worker, metric ingestion into the
database, and SSE delivery latency; prints a table and writes bench/results/service.json.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime
from pathlib import Path

import httpx

from api.stack import Stack
from bench.common import table, write_results
from core.broker import job_channel
from core.messages import Message
from core.settings import Settings
from db.connection import session_for
from db.jobs import claim_job, create_job
from workers.relay import Relay, Target

TINY = {
    "name": "bench",
    "model": {"kind": "mlp", "layers": 1, "d_model": 16, "seq_len": 8},
    "data": {"max_chars": 20_000},
    "train": {"steps": 1, "batch_size": 2, "eval_every": 1, "eval_batches": 1},
}


def _auth(stack: Stack) -> dict[str, str]:
    """Every request is authenticated as the stack's admin (a token lookup per request)."""
    return {"Authorization": f"Bearer {stack.admin_token}"}


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))]


def bench_submits(stack: Stack, n: int, threads: int) -> dict:
    """POST /api/jobs from `threads` keep-alive clients; no worker consumes meanwhile."""
    clients = [
        httpx.Client(base_url=stack.base_url, timeout=30, headers=_auth(stack)) for _ in range(threads)
    ]
    for c in clients:  # warm connections and the app
        c.post("/api/jobs", json=TINY).raise_for_status()
    per = n // threads

    def run(c: httpx.Client) -> None:
        for _ in range(per):
            c.post("/api/jobs", json=TINY).raise_for_status()

    t0 = time.perf_counter()
    with ThreadPoolExecutor(threads) as ex:
        list(ex.map(run, clients))
    dt = time.perf_counter() - t0
    # cancel what piled up, so the worker started next does not run hundreds of jobs
    c = clients[0]
    while True:
        queued = c.get("/api/jobs", params={"status": "queued", "limit": 500}).json()["items"]
        if not queued:
            break
        for j in queued:
            c.post(f"/api/jobs/{j['id']}/cancel")
    for c in clients:
        c.close()
    return {"submits": per * threads, "clients": threads, "seconds": dt, "submits_per_s": per * threads / dt}


def _ts(s: str) -> float:
    return datetime.fromisoformat(s).timestamp()


def bench_latency(stack: Stack, n: int) -> dict:
    """Sequential tiny jobs on a warm worker: created_at -> started_at (both stamped by the db
    writers on this machine's clock)."""
    lat = []
    with httpx.Client(base_url=stack.base_url, timeout=30, headers=_auth(stack)) as c:
        for i in range(n + 1):
            job = c.post("/api/jobs", json=TINY).json()
            while True:
                j = c.get(f"/api/jobs/{job['id']}").json()
                if j["status"] in ("succeeded", "failed", "cancelled"):
                    break
                time.sleep(0.05)
            if j["status"] != "succeeded":
                raise RuntimeError(f"latency job failed: {j['error']}")
            if i > 0:  # the first one warms the worker
                lat.append(_ts(j["started_at"]) - _ts(j["created_at"]))
    return {"jobs": n, "p50_s": pct(lat, 0.5), "p95_s": pct(lat, 0.95), "max_s": max(lat)}


def _running_job(settings: Settings) -> int:
    with session_for(settings.database_url) as s:
        job = create_job(s, name="bench-ingest", spec=TINY, steps=10**9)
        return job.id


def _relay(settings: Settings, job_id: int, flush_s: float = 0.2) -> Relay:
    """The worker's Relay on a job this benchmark holds the lease of."""
    with session_for(settings.database_url) as s:
        attempt = claim_job(s, job_id=job_id, owner=f"bench-{job_id}", worker="bench", lease_s=3600)
    assert attempt is not None
    target = Target(attempt=attempt, channels=(job_channel(job_id),))
    return Relay(settings, targets={None: target}, on_fenced=lambda _k: None, flush_s=flush_s)


def _metric(relay: Relay, step: int, value: float) -> None:
    relay.add(None, Message(kind="metric", seq=step, step=step, name="loss", value=value))


def bench_ingest(settings: Settings, n: int) -> dict:
    """Points through the worker's Relay (batched inserts, then a Redis publish per batch)."""
    relay = _relay(settings, _running_job(settings))
    t0 = time.perf_counter()
    for i in range(n):
        _metric(relay, i, 1.0 / (i + 1))
    relay.close()
    dt = time.perf_counter() - t0
    assert relay.points_written == n
    return {"points": n, "seconds": dt, "points_per_s": n / dt}


def bench_sse(stack: Stack, settings: Settings, n: int) -> dict:
    """A client on /api/jobs/{id}/stream; points published one at a time through the Relay.
    publish->client: from the Relay's flush (db insert + Redis publish) to the client parsing the
    frame; emit->client adds the Relay's batching interval (trainer line to client)."""
    job_id = _running_job(settings)
    received: dict[int, float] = {}
    ready = threading.Event()

    def client() -> None:
        with httpx.stream(
            "GET",
            f"{stack.base_url}/api/jobs/{job_id}/stream",
            headers=_auth(stack),
            timeout=httpx.Timeout(10, read=60),
        ) as r:
            ready.set()
            event = None
            for line in r.iter_lines():
                if line.startswith("event:"):
                    event = line[6:].strip()
                elif line.startswith("data:") and event == "metric":
                    received[json.loads(line[5:])["step"]] = time.perf_counter()
                    if len(received) >= n:
                        return

    t = threading.Thread(target=client, daemon=True)
    t.start()
    ready.wait(10)
    time.sleep(0.5)
    relay = _relay(settings, job_id, flush_s=0.2)
    flushed: dict[int, float] = {}
    emitted: dict[int, float] = {}
    for i in range(n):
        emitted[i] = time.perf_counter()
        _metric(relay, i, 1.0)
        if (
            i < n // 2
        ):  # first half flushed at once (publish latency), second half left to the batching thread
            flushed[i] = time.perf_counter()
            relay.flush()
        time.sleep(0.01)
    t.join(timeout=30)
    relay.close()
    pub = [(received[i] - flushed[i]) * 1e3 for i in flushed if i in received]
    end = [(received[i] - emitted[i]) * 1e3 for i in emitted if i in received and i not in flushed]
    return {
        "points": n,
        "received": len(received),
        "publish_to_client_p50_ms": pct(pub, 0.5),
        "publish_to_client_p95_ms": pct(pub, 0.95),
        "emit_to_client_p50_ms": pct(end, 0.5),
        "emit_to_client_p95_ms": pct(end, 0.95),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--submits", type=int, default=600)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--latency-jobs", type=int, default=20)
    ap.add_argument("--points", type=int, default=100_000)
    ap.add_argument("--sse", type=int, default=300)
    args = ap.parse_args()

    load = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        stack = Stack(root=Path(tmp), workers=0)
        with stack:
            settings = Settings(
                database_url=stack.database_url,
                broker_url=stack.broker_url,
                broker_signing_key=stack.broker_signing_key,  # its relay publishes as a worker's
                data_dir=Path(tmp),
            )
            submit = bench_submits(stack, args.submits, args.clients)
            ingest = bench_ingest(settings, args.points)
            sse = bench_sse(stack, settings, args.sse)
            stack.start_worker(1)
            latency = bench_latency(stack, args.latency_jobs)

    rows = [
        {
            "measure": "submit throughput",
            "target": ">= 300 jobs/s",
            "measured": f"{submit['submits_per_s']:.0f} jobs/s",
            "met": submit["submits_per_s"] >= 300,
        },
        {
            "measure": "submit -> running p50 (warm worker)",
            "target": "<= 1.5 s",
            "measured": f"{latency['p50_s']:.3f} s",
            "met": latency["p50_s"] <= 1.5,
        },
        {
            "measure": "submit -> running p95",
            "target": "-",
            "measured": f"{latency['p95_s']:.3f} s",
            "met": "-",
        },
        {
            "measure": "metric ingestion into the db",
            "target": ">= 20000 points/s",
            "measured": f"{ingest['points_per_s']:.0f} points/s",
            "met": ingest["points_per_s"] >= 20000,
        },
        {
            "measure": "SSE publish -> client p50",
            "target": "-",
            "measured": f"{sse['publish_to_client_p50_ms']:.1f} ms",
            "met": "-",
        },
        {
            "measure": "SSE publish -> client p95",
            "target": "<= 200 ms",
            "measured": f"{sse['publish_to_client_p95_ms']:.1f} ms",
            "met": sse["publish_to_client_p95_ms"] <= 200,
        },
        {
            "measure": "SSE trainer line -> client p95 (incl. 200 ms batching)",
            "target": "-",
            "measured": f"{sse['emit_to_client_p95_ms']:.1f} ms",
            "met": "-",
        },
    ]
    print(
        table(
            rows, title="Shardyard service benchmark (embedded stack: SQLite, local redis-server, 1 worker)"
        )
    )
    # the machine is shared: its load while this ran says how far the numbers can be compared
    extra = {"auth": "bearer token on every request", "load_avg_1m": load}
    path = write_results(
        "service",
        {"rows": rows, "submit": submit, "latency": latency, "ingest": ingest, "sse": sse, **extra},
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
