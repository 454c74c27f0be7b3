"""Scheduler benchmark.

1. Decision latency: 1,000 queued jobs (20 users, priorities 0-3, 1-8 ranks) and 50 workers
   (8 slots, 4 tasks each) simulated in a real database (SQLite file, or Postgres with
   --postgres), with the fleet full of running jobs. Each round one running job ends (outside the
   clock) and one real `Scheduler.tick()` is timed: lock, freeing, reading the queue and the fleet,
   ordering, placing, the conditional reservation, the task send (a recorder: no broker) and the
   wait reasons it writes. p50/p95/max wall time per decision, and the CPU time of the ticking
   thread (SQLite works in-process, so on a shared, loaded machine this is the closer estimate of
   what the tick costs on an idle one; Postgres work happens in the server and is not in it).
2. Makespan of a mixed queue under fair share vs FIFO: simulated time (no processes, no database)
   over the real decision code (`core.scheduler.plan`), called at every arrival and every job end.
   Three users: one floods 60 long 4-rank jobs, one sends 60 short 1-rank jobs a little later, one
   sends eight 16-rank jobs (gangs of two 8-slot workers) last; 8 workers of 8 slots.

    python -m bench.sched [--rounds 200] [--postgres]

Prints the tables and writes bench/results/sched.json (with the machine).
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from sqlalchemy.orm import Session

from bench.common import table, write_results
from core.scheduler import Box, Want, plan
from core.scheduler_loop import Scheduler
from core.settings import Settings
from db.connection import session_for
from db.jobs import claim_job, finish_job
from db.migrate import upgrade
from db.models import Job, JobStatus, Reservation
from db.users import create_user
from db.workers import record_heartbeat

GiB = 2**30
SPEC = {
    "model": {"kind": "gpt", "layers": 2, "d_model": 32, "heads": 2, "seq_len": 32, "vocab_size": 128},
    "train": {"steps": 10, "batch_size": 8},
}


def add_workers(s: Session, workers: int) -> None:
    """`workers` live workers of 8 slots and 4 tasks, each with its own node queue."""
    for w in range(workers):
        record_heartbeat(
            s,
            name=f"w{w}@bench",
            hostname="bench",
            queues=["cpu", "gpu", f"node.w{w}@bench"],
            devices=[{"type": "cpu"}],
            host={"slots": 8, "tasks": 4, "ram_bytes": 256 * GiB, "cpus": 8},
        )


def _setup(url: str, *, queued: int, workers: int, seed: int = 0) -> None:
    rng = random.Random(seed)
    upgrade(url)
    with session_for(url) as s:
        users = [
            create_user(s, name=f"user{i}", max_running_jobs=1000, max_ranks=10_000).id for i in range(20)
        ]
        add_workers(s, workers)
        s.add_all(
            Job(
                name=f"q{i}",
                spec=SPEC,
                priority=rng.choice([0, 0, 0, 1, 2, 3]),
                world_size=rng.choice([1, 1, 2, 4, 8]),
                owner_id=rng.choice(users),
                status=JobStatus.queued,
            )
            for i in range(queued + workers * 4)
        )
        s.commit()


class _Recorder:
    def __init__(self) -> None:
        self.sent: list[tuple[int, str]] = []

    def __call__(self, _settings: Settings, *, job_id: int, queue: str, node_rank: int, nnodes: int) -> None:
        self.sent.append((job_id, queue))


def claim_all(url: str) -> None:
    """Every job the scheduler placed is claimed by its worker (as a worker's task would)."""
    with session_for(url) as s:
        rows = s.query(Reservation).filter(Reservation.claimed_at.is_(None), Reservation.node_rank == 0).all()
        todo = [(r.job_id, r.worker) for r in rows]
    with session_for(url) as s:
        for job_id, worker in todo:
            claim_job(s, job_id=job_id, owner=f"bench:{job_id}", worker=worker, lease_s=3600, reserved=True)


def _finish_one(url: str, rng: random.Random) -> None:
    with session_for(url) as s:
        running = s.query(Job.id, Job.attempts, Job.owner).filter(Job.status == JobStatus.running).all()
        job_id, attempts, owner = rng.choice(running)
        from db.jobs import Attempt

        finish_job(s, attempt=Attempt(job_id, attempts, owner), status=JobStatus.succeeded)


def decision_latency(url: str, *, rounds: int, queued: int = 1000, workers: int = 50) -> dict[str, Any]:
    _setup(url, queued=queued, workers=workers)
    settings = Settings(database_url=url, worker_alive_s=3600, requeue_after_s=3600)
    rec = _Recorder()
    sched = Scheduler(settings, send=rec)
    t0 = time.perf_counter()
    sched.tick()  # fills the fleet (and reads every spec once)
    fill_s = time.perf_counter() - t0
    claim_all(url)
    rng = random.Random(1)
    times, cpu, placed = [], [], []
    for _ in range(rounds):
        _finish_one(url, rng)
        before = len(rec.sent)
        t, c = time.perf_counter(), time.thread_time()
        sched.tick()
        times.append((time.perf_counter() - t) * 1000)
        cpu.append((time.thread_time() - c) * 1000)
        placed.append(len(rec.sent) - before)
        claim_all(url)
    with session_for(url) as s:
        still = s.query(Job).filter(Job.status == JobStatus.queued).count()
    times.sort()
    cpu.sort()
    return {
        "database": url.split(":", 1)[0],
        "queued_jobs": queued,
        "workers": workers,
        "rounds": rounds,
        "first_tick_s": round(fill_s, 3),
        "p50_ms": round(statistics.median(times), 2),
        "p95_ms": round(times[int(0.95 * (len(times) - 1))], 2),
        "max_ms": round(times[-1], 2),
        "cpu_p50_ms": round(statistics.median(cpu), 2),
        "cpu_p95_ms": round(cpu[int(0.95 * (len(cpu) - 1))], 2),
        "mean_tasks_sent_per_tick": round(statistics.mean(placed), 2),
        "queued_at_end": still,
    }


# ---- makespan: simulated time over the real decision code ---------------------------------------


def _mixed_queue() -> list[tuple[float, Want, float]]:
    """(arrival s, job, duration s)"""
    rng = random.Random(7)
    out = []
    i = 0
    for k in range(60):  # user 1 floods long 4-rank jobs
        i += 1
        out.append(
            (0.0 + k * 0.01, Want(id=i, user=1, priority=0, created=0.0, ranks=4), rng.uniform(250, 350))
        )
    for k in range(60):  # user 2: short 1-rank jobs, a little later
        i += 1
        out.append(
            (5.0 + k * 0.01, Want(id=i, user=2, priority=0, created=0.0, ranks=1), rng.uniform(20, 40))
        )
    for k in range(8):  # user 3: 16-rank gangs, last
        i += 1
        out.append(
            (10.0 + k * 0.01, Want(id=i, user=3, priority=0, created=0.0, ranks=16), rng.uniform(150, 250))
        )
    return out


def simulate(*, fair: bool, workers: int = 8, slots: int = 8) -> dict[str, Any]:
    """Event-driven: at every arrival and every end, `plan` decides; placed jobs run for their
    duration. Fair share sees what each user runs now (slots) and their slot-minutes so far."""
    arrivals = sorted(_mixed_queue(), key=lambda a: a[0])
    duration = {w.id: d for _, w, d in arrivals}
    for t, w, _ in arrivals:
        w.created = t
    boxes = [
        Box(name=f"w{i}", queues=frozenset({"cpu"}), slots=slots, tasks=slots, gpus=0, ram=256 * GiB)
        for i in range(workers)
    ]
    now, queue, running = 0.0, [], []  # running: (end, want, nodes)
    started: dict[int, float] = {}
    ended: dict[int, float] = {}
    used: dict[int | None, float] = {}
    last: dict[int | None, float] = {}
    pending = list(arrivals)
    while pending or queue or running:
        next_arrival = pending[0][0] if pending else float("inf")
        next_end = min((r[0] for r in running), default=float("inf"))
        now = min(next_arrival, next_end)
        while pending and pending[0][0] <= now:
            queue.append(pending.pop(0)[1])
        for r in [r for r in running if r[0] <= now]:
            running.remove(r)
            end, w, nodes = r
            ended[w.id] = end
            used[w.user] = used.get(w.user, 0.0) + w.ranks * duration[w.id]
            for name, s, g, m in nodes:
                b = next(b for b in boxes if b.name == name)
                b.free_slots += s
                b.free_gpus += g
                b.free_ram += m
                b.free_tasks += 1
        run_slots: dict[int | None, int] = {}
        for _, w, _ in running:
            run_slots[w.user] = run_slots.get(w.user, 0) + w.ranks
        recent = {u: (int(used.get(u, 0.0) // 60), last.get(u, 0.0)) for u in set(used) | set(last)}
        d = plan(
            queue,
            boxes,
            now=now,
            aging_s=600.0,
            running_slots=run_slots,
            recent=recent,
            quotas={},
            fair=fair,
        )
        for w, nodes in d.placements:
            queue.remove(w)
            started[w.id] = now
            last[w.user] = now
            running.append((now + duration[w.id], w, nodes))
    by_user: dict[int, list[float]] = {}
    waits: dict[int, list[float]] = {}
    for t, w, _ in arrivals:
        by_user.setdefault(w.user, []).append(ended[w.id] - t)
        waits.setdefault(w.user, []).append(started[w.id] - t)
    return {
        "policy": "fair share" if fair else "FIFO",
        "makespan_s": round(max(ended.values()), 1),
        **{f"user{u}_mean_turnaround_s": round(statistics.mean(v), 1) for u, v in sorted(by_user.items())},
        **{f"user{u}_max_wait_s": round(max(v), 1) for u, v in sorted(waits.items())},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=200)
    ap.add_argument("--postgres", action="store_true", help="also on a throwaway PostgreSQL server")
    args = ap.parse_args()
    rows = []
    with ExitStack() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory()))
        rows.append(decision_latency(f"sqlite:///{tmp / 'bench.db'}", rounds=args.rounds))
        if args.postgres:
            from tests.postgres import postgres_server

            rows.append(decision_latency(stack.enter_context(postgres_server()), rounds=args.rounds))
    print(table(rows, title="Decision latency (one Scheduler.tick per decision; goal p95 <= 50 ms)"))
    sim = [simulate(fair=True), simulate(fair=False)]
    print(table(sim, title="Mixed queue, simulated time over core.scheduler.plan (8 workers x 8 slots)"))
    try:
        load = list(__import__("os").getloadavg())
    except OSError:
        load = []
    path = write_results(
        "sched",
        {
            "decision_latency": rows,
            "makespan_simulated": sim,
            "note": "makespan is simulated time over the real decision code (no processes)",
            "loadavg_after": load,
        },
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
