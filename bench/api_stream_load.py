"""bench.api_load's load with a streamed job of a fixed pace: no worker runs it; this process
writes its metric points to the database and publishes them on its channel, as the worker's relay
does (one batch every 0.2 s), at `--points-per-s`.

bench.api_load's trainer runs as fast as the machine lets it: on a quiet 2-core VM its job sends
the 50 streams 15-20 MB/s of frames, on a loaded one a few hundred kB/s, so the API's stream load
there depends on what else runs. Here it does not, and the API process's CPU seconds and the
streams' database reads (`shardyard_sse_database_*`) can be compared between runs on a busy machine.

    python -m bench.api_stream_load [--points-per-s 4000] [--seconds 30] [--name api_stream_load]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import threading
import time
from pathlib import Path

import redis
from sqlalchemy import create_engine, text

import bench.api_load as api_load
from api.stack import Stack
from bench.common import add_load_options, table, write_results
from core.broker import job_channel, sign_live

NAMES = ("train/loss", "train/lr", "train/step_s", "train/tokens_per_s")
BATCH_S = 0.2
SLOW_START_S = 6.0
"""One step a batch until then: bench.api_load opens its streams at step 5, and on a real job they
replay a few points, not seconds of a fast job's."""


def cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / 100.0  # utime + stime, in clock ticks of 10 ms


def play_worker(stack: Stack, *, job_id: int, points_per_s: float, stop: threading.Event, out: dict) -> None:
    engine = create_engine(stack.database_url)
    broker = redis.Redis.from_url(stack.broker_url)
    key = stack.broker_signing_key.encode()
    while not stop.is_set():  # bench.api_load submits the streamed job first
        with engine.begin() as cx:
            if cx.execute(text("SELECT count(*) FROM jobs WHERE id = :j"), {"j": job_id}).scalar():
                break
        time.sleep(0.05)
    began = time.monotonic()
    step = point_id = 0
    while not stop.is_set():
        t0 = time.monotonic()
        steps = int(points_per_s * BATCH_S / len(NAMES)) if t0 - began > SLOW_START_S else 1
        now = time.time()
        rows = []
        for _ in range(steps):
            step += 1
            for name in NAMES:
                point_id += 1
                rows.append(
                    {
                        "id": point_id,
                        "job_id": job_id,
                        "step": step,
                        "name": name,
                        "value": 1.0 / step,
                        "time": now,
                    }
                )
        with engine.begin() as cx:  # committed first, then published (workers/relay.py)
            cx.execute(
                text(
                    "INSERT INTO metric_points (id, job_id, step, name, value, time) "
                    "VALUES (:id, :job_id, :step, :name, :value, :time)"
                ),
                rows,
            )
            cx.execute(text("UPDATE jobs SET step = :s WHERE id = :j"), {"s": step, "j": job_id})
        # signed as the worker's publisher does: the API shows no message it cannot verify
        body = json.dumps({"type": "metrics", "points": rows}).encode()
        broker.publish(job_channel(job_id), sign_live(key, channel=job_channel(job_id), body=body))
        out["messages"] = out.get("messages", 0) + 1
        out["points"] = out.get("points", 0) + len(rows)
        time.sleep(max(0.0, BATCH_S - (time.monotonic() - t0)))
    broker.close()
    engine.dispose()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--points-per-s", type=float, default=4000.0)
    add_load_options(ap, name="api_stream_load")
    args = ap.parse_args()
    published: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        env = {"SHARDYARD_SSE_MAX_PER_CLIENT": str(args.streams + 10), "SHARDYARD_STALL_LOG_S": "0.5"}
        with Stack(root=Path(tmp), workers=0, extra_env=env, shutdown_s=30) as stack:
            stop = threading.Event()
            worker = threading.Thread(
                target=play_worker,
                kwargs={
                    "stack": stack,
                    "job_id": 1,
                    "points_per_s": args.points_per_s,
                    "stop": stop,
                    "out": published,
                },
                daemon=True,
            )
            worker.start()
            api_pid = stack.procs["api"].pid
            cpu = [cpu_s(api_pid)]
            res = api_load.run(stack, streams=args.streams, rate=args.submits_per_s, seconds=args.seconds)
            cpu.append(cpu_s(api_pid))
            stop.set()
            worker.join(timeout=10)
            api_log = (Path(tmp) / "api.log").read_text(errors="replace")
            res["stall_reports"] = [
                "request(s) waiting over" + part.split("\n\n\n")[0][:20000]
                for part in api_log.split("request(s) waiting over")[1:]
            ]
    res["points_per_s_target"] = args.points_per_s
    res["published"] = published
    res["api_cpu_s"] = cpu[1] - cpu[0]
    rows = [
        {"route": r, "requests": v["n"], "p50 ms": v["p50_ms"], "p95 ms": v["p95_ms"], "p99 ms": v["p99_ms"]}
        for r, v in [*res["routes"].items(), ("all", res["all"])]
    ]
    load = res["load_average_1m"]
    print(
        table(
            rows,
            title=f"API latency, {res['streams']} streams on a job publishing {args.points_per_s:.0f} points/s "
            f"({published.get('messages', 0)} messages, {res['stream_bytes'] / 1e6:.0f} MB to the streams); "
            f"load average {min(load):.1f}-{max(load):.1f}; API CPU {res['api_cpu_s']:.1f} s",
        )
    )
    print(f"streams' database reads (and rows framed), by why: {res.get('stream_database_reads')}")
    print(f"stall reports: {len(res['stall_reports'])}")
    print(f"wrote {write_results(args.name, res)}")


if __name__ == "__main__":
    main()
