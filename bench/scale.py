"""The service at a busy team's scale, on SQLite and on PostgreSQL: 100,000 jobs of 20 users in
every state, 10 million metric points (one job of 1 million), a selection batch of 1,000 trials
(bench/scale_seed.py writes them through db/, not the API). On each database the real service
runs (api.stack: redis-server and uvicorn, no worker, the embedded scheduler off so nothing
else writes) and this measures, one client at a time:

- GET /api/jobs, the first page, with each filter the dashboard's jobs table offers (status,
  owner, name, none; it sorts newest first only), as the admin and as a user: p95 of each;
- the jobs page in Chromium: navigation to its first row drawn;
- GET /api/selections/{id} of the 1,000-trial batch: p95; its page in Chromium: navigation to the
  leaderboard's first 100 rows (the rest behind "Show all"), the parallel coordinates' 1,000 lines
  and every trial's curve drawn;
- the 1-million-point job's chart series (GET /api/jobs/{id}/metrics?max_points=1000, what the
  job page asks): the first read of the job (cold: the API holds none of its points) and again;
- the scheduler (core/scheduler_loop.py Scheduler.tick, in this process, as bench.sched) with 10,000
  jobs queued and 500 workers, a running job ending before each tick: p95 of the decision (from
  the tick's start through its placements reserved, committed and their tasks sent) and p95 of the
  whole tick (with the waiting jobs' reasons written after that, in their own transaction);
- the database's bytes per million metric points (the points table and its indexes).

    python -m bench.scale [--jobs 100000] [--points 10000000] [--only sqlite|postgres]

Prints a table per database and writes bench/results/scale.json naming the machine.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import secrets
import statistics
import tempfile
import time
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx
from sqlalchemy import func, select, text

from api.stack import Stack
from bench.common import RESULTS, add_results_option, table, write_results
from bench.scale_seed import Seeded, Sizes, seed
from bench.sched import add_workers, claim_all
from core.scheduler_loop import Scheduler
from core.settings import Settings
from db.connection import get_engine, session_for
from db.jobs import Attempt, finish_job
from db.models import Job, JobStatus, Reservation
from db.users import add_token

CHROMIUM = "/usr/bin/chromium"
BOARD_ROWS = 100
"""The leaderboard's rows before its "Show all" (frontend/src/pages/selections.ts)."""
CHROMIUM_ARGS = ["--no-sandbox", "--headless", "--disable-gpu", "--disable-background-networking"]
GOALS = {
    "jobs_list_p95_ms": 100.0,
    "jobs_page_first_row_s": 1.0,
    "batch_get_p95_ms": 200.0,
    "batch_page_drawn_s": 2.0,
    "series_1m_ms": 200.0,
    "scheduler_decision_p95_ms": 50.0,
}


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))]


def _timed(n: int, call: Callable[[], httpx.Response]) -> list[float]:
    """`n` sequential calls' wall times in ms, after two untimed ones (connection, first use)."""
    for _ in range(2):
        call().raise_for_status()
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        r = call()
        out.append((time.perf_counter() - t0) * 1e3)
        r.raise_for_status()
    return out


def _user_token(url: str, user_id: int) -> str:
    secret = "sy_" + secrets.token_urlsafe(32)
    with session_for(url) as s:
        add_token(
            s, user_id=user_id, token_hash=hashlib.sha256(secret.encode()).hexdigest(), prefix=secret[:8]
        )
    return secret


def jobs_list(stack: Stack, user_token: str, *, n: int) -> dict[str, dict[str, float]]:
    """The first page (50, newest first) under each filter the jobs table offers."""
    cases: list[tuple[str, str, dict[str, Any]]] = [("admin: no filter", "admin", {})]
    cases += [(f"admin: status={s}", "admin", {"status": s}) for s in JobStatus]
    cases += [
        ("admin: owner=user07", "admin", {"owner": "user07"}),
        ("admin: name contains 'llama'", "admin", {"name": "llama"}),
        ("admin: name matches nothing", "admin", {"name": "no-such-job"}),
        ("admin: owner=user07, status=failed", "admin", {"owner": "user07", "status": "failed"}),
        ("admin: owner=user07, status=queued", "admin", {"owner": "user07", "status": "queued"}),
        ("user: own jobs", "user", {}),
        ("user: status=queued", "user", {"status": "queued"}),
        ("user: name contains 'gpt'", "user", {"name": "gpt"}),
    ]
    out = {}
    tokens = {"admin": stack.admin_token, "user": user_token}
    for who in tokens:
        with httpx.Client(base_url=stack.base_url, timeout=60, headers=_bearer(tokens[who])) as c:
            for label, w, params in cases:
                if w != who:
                    continue
                q = {"limit": 50, **params}
                ms = _timed(n, lambda q=q: c.get("/api/jobs", params=q))
                out[label] = {"p50_ms": pct(ms, 0.5), "p95_ms": pct(ms, 0.95), "max_ms": max(ms)}
    return out


def _bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def batch_get(stack: Stack, selection_id: int, *, n: int) -> dict[str, float]:
    with httpx.Client(base_url=stack.base_url, timeout=60, headers=_bearer(stack.admin_token)) as c:
        ms = _timed(n, lambda: c.get(f"/api/selections/{selection_id}"))
        size = len(c.get(f"/api/selections/{selection_id}").content)
    return {"p50_ms": pct(ms, 0.5), "p95_ms": pct(ms, 0.95), "max_ms": max(ms), "bytes": size}


def series_1m(stack: Stack, job_id: int, others: list[int], *, rounds: int) -> dict[str, float]:
    """The job page's request for the big job: the job's first read ever, then cold reads (the API
    process holds none of its points: reads of enough other jobs have pushed it out of the
    per-process cache, api/series.py), each followed by a warm one."""
    url = f"/api/jobs/{job_id}/metrics"
    params = {"max_points": 1000}
    cold, warm = [], []
    with httpx.Client(base_url=stack.base_url, timeout=120, headers=_bearer(stack.admin_token)) as c:
        for _ in range(rounds):
            for other in others:
                c.get(f"/api/jobs/{other}/metrics", params=params).raise_for_status()
            t0 = time.perf_counter()
            r = c.get(url, params=params)
            cold.append((time.perf_counter() - t0) * 1e3)
            r.raise_for_status()
            t0 = time.perf_counter()
            c.get(url, params=params).raise_for_status()
            warm.append((time.perf_counter() - t0) * 1e3)
        answered = sum(len(s["steps"]) for s in r.json()["series"].values())
    # the first read of the job reads every point and stores its series summarized (api/series.py);
    # every later cold read (another process, a restart, an entry pushed out) starts from those
    later = cold[1:] or cold
    return {
        "first_read_ms": cold[0],
        "cold_median_ms": statistics.median(later),
        "cold_max_ms": max(later),
        "warm_median_ms": statistics.median(warm),
        "warm_max_ms": max(warm),
        "points_answered": answered,
        "rounds": rounds,
    }


def browser(stack: Stack, selection_id: int, *, trials: int, loads: int) -> dict[str, Any]:
    """Navigation to drawn, in Chromium (one signed-in tab per load, the cache warm after the
    first): the jobs page's first row; the batch page's leaderboard (its first BOARD_ROWS rows, in
    rank order), parallel coordinates (every trial's line) and curves (every trial's curve in the
    chart: the page marks #curves-chart[data-curves-loaded])."""
    from playwright.sync_api import sync_playwright

    jobs_s: list[float] = []
    batch_s: list[float] = []
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        ctx = b.new_context(viewport={"width": 1400, "height": 900})
        ctx.request.post(f"{stack.base_url}/api/auth/session", data={"token": stack.admin_token})
        for _ in range(loads):
            pg = ctx.new_page()
            t0 = time.perf_counter()
            pg.goto(f"{stack.base_url}/#/")
            pg.wait_for_selector("#jobs-table tbody tr[data-job-id]", timeout=60_000)
            jobs_s.append(time.perf_counter() - t0)
            pg.close()
        for _ in range(loads):
            pg = ctx.new_page()
            t0 = time.perf_counter()
            pg.goto(f"{stack.base_url}/#/selections/{selection_id}")
            pg.wait_for_function(
                """([n, rows]) => document.querySelectorAll('#leaderboard tbody tr').length >= rows
                    && document.querySelectorAll('#parcoords svg polyline').length >= n
                    && document.querySelector('#curves-chart[data-curves-loaded]') !== null""",
                arg=[trials, min(trials, BOARD_ROWS)],
                timeout=120_000,
                polling="raf",
            )
            batch_s.append(time.perf_counter() - t0)
            pg.close()
        b.close()
    return {
        "jobs_page_first_row_s": jobs_s,
        "batch_page_drawn_s": batch_s,
        "loads": loads,
    }


# ---- the scheduler on the seeded database -----------------------------------------------------


class _Recorder:
    def __init__(self) -> None:
        self.sent = 0

    def __call__(self, _settings: Settings, **_kw: Any) -> None:
        self.sent += 1


def scheduler(url: str, *, workers: int, rounds: int) -> dict[str, Any]:
    """bench.sched's decision latency on the seeded database: `workers` workers of 8 slots and 4
    tasks; the first tick fills the fleet from the queue; then each round one placed job ends
    (outside the clock) and one tick is timed (Scheduler.last): `p*_ms` up to its placements
    committed and sent, `tick_p*_ms` with the wait reasons written too; `cpu_p95_ms` and
    `tick_cpu_p95_ms` the same spans' CPU time in this process."""
    with session_for(url) as s:
        add_workers(s, workers)
    settings = Settings(database_url=url, worker_alive_s=3600, requeue_after_s=3600)
    rec = _Recorder()
    sched = Scheduler(settings, send=rec, send_group=rec)
    t0 = time.perf_counter()
    sched.tick()
    first = time.perf_counter() - t0
    claim_all(url)
    with session_for(url) as s:
        queued = s.scalar(select(func.count()).where(Job.status == JobStatus.queued, Job.kind == "job")) or 0
    rng = random.Random(1)
    times, ticks, cpu, tick_cpu, placed = [], [], [], [], []
    for _ in range(rounds):
        with session_for(url) as s:
            held = s.execute(
                select(Job.id, Job.attempts, Job.owner)
                .join(Reservation, Reservation.job_id == Job.id)
                .where(Job.status == JobStatus.running, Reservation.node_rank == 0)
            ).all()
            job_id, attempts, owner = rng.choice(held)
            finish_job(s, attempt=Attempt(job_id, attempts, owner), status=JobStatus.succeeded)
        before = rec.sent
        sched.tick()
        assert sched.last is not None
        times.append(sched.last.placed * 1e3)
        ticks.append(sched.last.total * 1e3)
        cpu.append(sched.last.placed_cpu * 1e3)
        tick_cpu.append(sched.last.total_cpu * 1e3)
        placed.append(rec.sent - before)
        claim_all(url)
    return {
        "workers": workers,
        "queued_jobs": queued,
        "rounds": rounds,
        "first_tick_s": first,
        "p50_ms": statistics.median(times),
        "p95_ms": pct(times, 0.95),
        "max_ms": max(times),
        "tick_p50_ms": statistics.median(ticks),
        "tick_p95_ms": pct(ticks, 0.95),
        "tick_max_ms": max(ticks),
        "cpu_p95_ms": pct(cpu, 0.95),
        "tick_cpu_p95_ms": pct(tick_cpu, 0.95),
        "tasks_sent_per_tick": statistics.mean(placed),
    }


def points_mb(url: str) -> float:
    """MB the metric points take: the table and its indexes."""
    engine = get_engine(url)
    with engine.connect() as c:
        if engine.dialect.name == "sqlite":
            c.exec_driver_sql("PRAGMA wal_checkpoint(TRUNCATE)")
            names = "('metric_points', 'ix_metric_points_job_id', 'ix_metric_points_job_name_step')"
            try:
                used = c.scalar(text(f"SELECT SUM(pgsize) FROM dbstat WHERE name IN {names}"))
            except Exception:  # noqa: BLE001 - a build without dbstat: the whole file
                used = os.path.getsize(engine.url.database or "")
        else:
            used = c.scalar(text("SELECT pg_total_relation_size('metric_points')"))
    return float(used or 0) / 1e6


# ---- one database --------------------------------------------------------------------------------


def run_one(url: str, root: Path, sizes: Sizes, args: argparse.Namespace) -> dict[str, Any]:
    print(f"seeding {url.split(':', 1)[0]} ...")
    seeded: Seeded = seed(url, sizes)
    if args.scheduler_only:
        load = [os.getloadavg()[0]]
        sched = scheduler(url, workers=args.workers, rounds=args.rounds)
        load.append(os.getloadavg()[0])
        return {
            "scheduler_decision_p95_ms": sched["p95_ms"],
            "scheduler_tick_p95_ms": sched["tick_p95_ms"],
            "scheduler_workers": sched["workers"],
            "scheduler_queued_jobs": sched["queued_jobs"],
            "scheduler": {**sched, "load_average_1m": load, "time": time.strftime("%Y-%m-%dT%H:%M:%SZ")},
        }
    mb = points_mb(url)
    load = [os.getloadavg()[0]]
    env = {"SHARDYARD_EMBEDDED_SCHEDULER": "false", "SHARDYARD_STALL_LOG_S": "5"}
    with Stack(root=root, workers=0, database_url=url, extra_env=env) as stack:
        user = _user_token(url, seeded.users[7])
        lists = jobs_list(stack, user, n=args.requests)
        load.append(os.getloadavg()[0])
        batch = batch_get(stack, seeded.selection_id, n=args.requests)
        with session_for(url) as s:
            others = list(
                s.scalars(
                    select(Job.id)
                    .where(Job.status == JobStatus.succeeded, Job.id != seeded.big_job_id)
                    .order_by(Job.id.desc())
                    .limit(40)
                )
            )
        series = series_1m(stack, seeded.big_job_id, others, rounds=args.series_rounds)
        load.append(os.getloadavg()[0])
        pages = browser(stack, seeded.selection_id, trials=seeded.trials, loads=args.page_loads)
        load.append(os.getloadavg()[0])
    sched = scheduler(url, workers=args.workers, rounds=args.rounds)
    load.append(os.getloadavg()[0])
    return {
        "jobs": seeded.jobs,
        "points": seeded.points,
        "trials": seeded.trials,
        "users": len(seeded.users),
        "seed_seconds": {k: round(v, 1) for k, v in seeded.seconds.items()},
        "jobs_list_p95_ms": max(v["p95_ms"] for v in lists.values()),
        "jobs_page_first_row_s": statistics.median(pages["jobs_page_first_row_s"]),
        "batch_get_p95_ms": batch["p95_ms"],
        "batch_page_drawn_s": statistics.median(pages["batch_page_drawn_s"]),
        "series_1m_ms": series["cold_median_ms"],
        "series_1m_first_ms": series["first_read_ms"],
        "scheduler_decision_p95_ms": sched["p95_ms"],
        "scheduler_tick_p95_ms": sched["tick_p95_ms"],
        "scheduler_workers": sched["workers"],
        "scheduler_queued_jobs": sched["queued_jobs"],
        "db_mb_per_million_points": mb / (seeded.points / 1e6),
        "jobs_list": lists,
        "batch_get": batch,
        "series_1m": series,
        "pages": pages,
        "scheduler": sched,
        "load_average_1m": load,
    }


def _rows(name: str, r: dict[str, Any]) -> list[dict[str, Any]]:
    def row(measure: str, key: str, unit: str, goal: str) -> dict[str, Any]:
        v = r[key]
        return {
            "database": name,
            "measure": measure,
            "measured": f"{v:.3g} {unit}" if unit == "s" else f"{v:.1f} {unit}",
            "goal": goal,
            "met": v <= GOALS[key] if key in GOALS else "-",
        }

    return [
        row("GET /api/jobs first page, worst filter's p95", "jobs_list_p95_ms", "ms", "<= 100 ms"),
        row("jobs page: first row drawn (median)", "jobs_page_first_row_s", "s", "<= 1 s"),
        row("GET the 1,000-trial batch, p95", "batch_get_p95_ms", "ms", "<= 200 ms"),
        row("batch page drawn (median)", "batch_page_drawn_s", "s", "<= 2 s"),
        row("1M-point job's chart series, cold read (median)", "series_1m_ms", "ms", "<= 200 ms"),
        row("  the job's first read ever (stores its summary)", "series_1m_first_ms", "ms", "-"),
        row(
            f"scheduler decision p95 ({r['scheduler_queued_jobs']} queued, {r['scheduler_workers']} workers)",
            "scheduler_decision_p95_ms",
            "ms",
            "<= 50 ms",
        ),
        row("  the whole tick, wait reasons written too (p95)", "scheduler_tick_p95_ms", "ms", "-"),
        row("MB per million metric points", "db_mb_per_million_points", "MB", "-"),
    ]


def _merge_scheduler(name: str, results: dict[str, Any]) -> None:
    """`--scheduler-only`: the scheduler's fields of each database measured replace those in the
    results file (every other measure keeps the run that wrote it)."""
    path = RESULTS / f"{name}.json"
    doc = json.loads(path.read_text()) if path.exists() else {"benchmark": name, "goals": GOALS}
    for db, r in results.items():
        doc.setdefault(db, {}).update(r)
        print(
            f"{db}: scheduler decision p95 {r['scheduler_decision_p95_ms']:.1f} ms,"
            f" tick p95 {r['scheduler_tick_p95_ms']:.1f} ms",
            r["scheduler"],
        )
    path.write_text(json.dumps(doc, indent=2) + "\n")
    print(f"updated {path}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--jobs", type=int, default=100_000)
    ap.add_argument("--points", type=int, default=10_000_000)
    ap.add_argument("--trials", type=int, default=1_000)
    ap.add_argument("--queued", type=int, default=10_000)
    ap.add_argument("--workers", type=int, default=500)
    ap.add_argument("--rounds", type=int, default=100, help="scheduler decisions timed")
    ap.add_argument("--requests", type=int, default=40, help="timed requests per route and filter")
    ap.add_argument("--series-rounds", type=int, default=6)
    ap.add_argument("--page-loads", type=int, default=5)
    ap.add_argument("--only", choices=["sqlite", "postgres"])
    ap.add_argument(
        "--scheduler-only",
        action="store_true",
        help="seed and time the scheduler only; its fields replace those in the results file, the "
        "rest of which is kept",
    )
    add_results_option(ap, default="scale")
    args = ap.parse_args()
    sizes = Sizes(
        jobs=args.jobs,
        points=args.points,
        trials=args.trials,
        queued=args.queued,
        fleet_fill=args.workers * 4,
        big_job_points=min(1_000_000, args.points // 10),
    )
    results: dict[str, Any] = {}
    with ExitStack() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="perf-scale-")))
        if args.only in (None, "sqlite"):
            results["sqlite"] = run_one(
                f"sqlite:///{tmp / 'sqlite' / 'shardyard.db'}", tmp / "sqlite", sizes, args
            )
        if args.only in (None, "postgres"):
            from tests.postgres import postgres_server

            pg = stack.enter_context(postgres_server())
            results["postgres"] = run_one(pg, tmp / "postgres", sizes, args)
    if args.scheduler_only:
        _merge_scheduler(args.name, results)
        return
    rows = [row for name, r in results.items() for row in _rows(name, r)]
    print(
        table(
            rows, title=f"Shardyard at scale ({args.jobs} jobs, {args.points} points, {args.trials} trials)"
        )
    )
    for name, r in results.items():
        print(
            table(
                [{"filter": k, **{m: round(v, 1) for m, v in x.items()}} for k, x in r["jobs_list"].items()],
                title=f"{name}: GET /api/jobs first page",
            )
        )
    path = write_results(args.name, {"goals": GOALS, **results})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
