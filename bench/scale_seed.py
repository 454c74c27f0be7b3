"""A database at a busy team's scale, written straight through db/'s tables (not the API): users,
100,000 jobs in every state, 10 million metric points (one job of 1 million), and a selection
batch of 1,000 trials. bench/scale.py measures the service on it.

Rows go in as the driver's bulk inserts: SQLAlchemy Core executemany for jobs and trials, and for
the points the DB-API cursor directly (SQLite: executemany in transactions of a million rows;
PostgreSQL: COPY), in the order a worker's relay writes them (a job's steps in turn, every series
of a step together), so the tables' layout is a real one.
"""

from __future__ import annotations

import io
import math
import random
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import insert, select

from db.connection import get_engine, session_for
from db.migrate import upgrade
from db.models import Job, JobStatus, MetricPoint, Selection, Trial
from db.users import create_user

SPEC: dict[str, Any] = {
    "model": {"kind": "gpt", "layers": 4, "d_model": 128, "heads": 4, "seq_len": 64},
    "data": {"kind": "text", "corpus": "stdlib"},
    "train": {"steps": 1000, "batch_size": 16, "lr": 3e-4, "optimizer": "adamw", "seed": 0},
}
FAMILIES = ("gpt-8l", "llama-small", "mlp-probe", "gpt-2l", "bert-ish", "vit-tiny")
SPACE = {
    "train.lr": {"low": 1e-5, "high": 1e-2, "log": True},
    "model.layers": [2, 4, 6, 8],
    "train.batch_size": [8, 16, 32],
    "train.weight_decay": {"low": 0.0, "high": 0.1},
}


@dataclass(kw_only=True, slots=True)
class Sizes:
    """What the seeded database holds."""

    jobs: int = 100_000
    """Plain jobs (a batch's trials are jobs too, on top of these)."""
    users: int = 20
    points: int = 10_000_000
    """Metric points in all: the big job's, the trials', and the rest spread over ended jobs."""
    big_job_points: int = 1_000_000
    """One job's points (two series of half as many steps): the chart of a long run."""
    trials: int = 1_000
    trial_steps: int = 500
    """Each trial's train_loss points; it has a val_loss point every 10 steps besides."""
    queued: int = 10_000
    """Jobs left queued after the scheduler has filled the fleet (bench.scale's decisions)."""
    fleet_fill: int = 2_000
    """Further queued jobs, enough to fill the fleet the scheduler measure registers."""
    running: int = 1_000
    points_per_job: int = 1_000

    def __post_init__(self) -> None:
        rest = self.points - self.big_job_points - self.trial_points
        if rest < 0:
            raise ValueError(f"points ({self.points}) < the big job's and the trials' ({self.points - rest})")
        ended = self.jobs - self.queued - self.fleet_fill - self.running - 1
        if ended < math.ceil(rest / self.points_per_job):
            raise ValueError(
                f"{ended} ended jobs cannot hold {rest} points at {self.points_per_job} a job: raise jobs"
            )

    @property
    def trial_points(self) -> int:
        return self.trials * (self.trial_steps + self.trial_steps // 10)


@dataclass(slots=True)
class Seeded:
    jobs: int = 0
    trials: int = 0
    points: int = 0
    users: list[int] = field(default_factory=list)
    big_job_id: int = 0
    selection_id: int = 0
    seconds: dict[str, float] = field(default_factory=dict)


def _statuses(sizes: Sizes, rng: random.Random) -> list[str]:
    ended = sizes.jobs - sizes.queued - sizes.fleet_fill - sizes.running
    # of the ended: 70% succeeded, 18% failed, 12% cancelled
    failed, cancelled = int(ended * 0.18), int(ended * 0.12)
    out = (
        [JobStatus.succeeded] * (ended - failed - cancelled)
        + [JobStatus.failed] * failed
        + [JobStatus.cancelled] * cancelled
        + [JobStatus.running] * sizes.running
    )
    rng.shuffle(out)
    # the queue is the newest jobs, as it is on a live service
    return [str(s) for s in out] + [str(JobStatus.queued)] * (sizes.queued + sizes.fleet_fill)


def _job_rows(sizes: Sizes, users: list[int], rng: random.Random) -> Iterator[dict[str, Any]]:
    now = datetime.now(UTC)
    first = now - timedelta(days=180)
    span = (now - first).total_seconds()
    statuses = _statuses(sizes, rng)
    lease = now + timedelta(days=1)
    for i, status in enumerate(statuses):
        created = first + timedelta(seconds=span * i / len(statuses))
        ended = status not in (JobStatus.queued, JobStatus.running)
        started = created + timedelta(seconds=rng.uniform(1, 120)) if status != JobStatus.queued else None
        finished = started + timedelta(seconds=rng.uniform(60, 7200)) if ended and started else None
        steps = rng.choice([200, 500, 1000, 5000])
        yield {
            "name": f"{rng.choice(FAMILIES)}-{i}",
            "kind": "job",
            "spec": SPEC,
            "status": status,
            "priority": rng.choice([0, 0, 0, 1, 2, 3]),
            "queue": "cpu",
            "world_size": rng.choice([1, 1, 2, 4, 8]),
            "attempts": 0 if status == JobStatus.queued else 1,
            "step": steps
            if status == JobStatus.succeeded
            else (0 if status == JobStatus.queued else steps // 3),
            "steps": steps,
            "last_loss": None if status == JobStatus.queued else rng.uniform(1.0, 4.0),
            "created_at": created,
            "enqueued_at": created,
            "started_at": started,
            "finished_at": finished,
            "worker": None if status == JobStatus.queued else f"w{rng.randrange(500)}@bench",
            "owner": "seed" if status == JobStatus.running else None,
            "lease_until": lease if status == JobStatus.running else None,
            "run_seconds": (finished - started).total_seconds() if finished and started else 0.0,
            "error": "RuntimeError: loss is NaN at step 312" if status == JobStatus.failed else None,
            "result": {"final_loss": rng.uniform(1.0, 3.0)} if status == JobStatus.succeeded else None,
            "owner_id": rng.choice(users),
        }


def _points_of(job_id: int, names: tuple[str, ...], steps: int, t0: float) -> Iterator[tuple]:
    """(job_id, step, name, value, time) in relay order: every series of a step together."""
    for step in range(1, steps + 1):
        loss = 4.0 / math.sqrt(step) + 0.5
        for k, name in enumerate(names):
            yield (job_id, step, name, loss * (1 + 0.1 * k), t0 + step * 0.05)


def _trial_points(job_id: int, steps: int, t0: float, scale: float) -> Iterator[tuple]:
    for step in range(1, steps + 1):
        loss = scale * (4.0 / math.sqrt(step) + 0.5)
        yield (job_id, step, "train_loss", loss, t0 + step * 0.05)
        if step % 10 == 0:
            yield (job_id, step, "val_loss", loss * 1.05, t0 + step * 0.05)


class _PointWriter:
    """Bulk writes of metric points: COPY on PostgreSQL, executemany in big transactions on
    SQLite (its journal off while seeding: a crash leaves a half-seeded file to delete)."""

    CHUNK = 200_000

    def __init__(self, url: str) -> None:
        self.engine = get_engine(url)
        self.sqlite = self.engine.dialect.name == "sqlite"
        self.raw = self.engine.raw_connection()
        self.cur = self.raw.cursor()
        if self.sqlite:
            self.cur.execute("PRAGMA synchronous=OFF")
        self.buf: list[tuple] = []
        self.count = 0
        self.pending = 0

    def add(self, rows: Iterator[tuple]) -> None:
        self.buf.extend(rows)
        if len(self.buf) >= self.CHUNK:
            self.flush()

    def flush(self) -> None:
        if not self.buf:
            return
        table = MetricPoint.__tablename__
        if self.sqlite:
            self.cur.executemany(
                f"INSERT INTO {table} (job_id, step, name, value, time) VALUES (?, ?, ?, ?, ?)", self.buf
            )
        else:
            text = io.StringIO("".join(f"{j}\t{s}\t{n}\t{v!r}\t{t!r}\n" for j, s, n, v, t in self.buf))
            self.cur.copy_expert(f"COPY {table} (job_id, step, name, value, time) FROM STDIN", text)
        self.count += len(self.buf)
        self.pending += len(self.buf)
        self.buf = []
        if self.pending >= 1_000_000:
            self.raw.commit()
            self.pending = 0

    def close(self) -> None:
        self.flush()
        self.raw.commit()
        if self.sqlite:
            self.cur.execute("PRAGMA synchronous=NORMAL")
        self.cur.close()
        self.raw.close()


def _seed_selection(url: str, *, sizes: Sizes, owner: int, rng: random.Random) -> tuple[int, list[int]]:
    """The batch, its trials' jobs and its trials; returns (selection id, the trials' job ids)."""
    now = datetime.now(UTC)
    with session_for(url) as s:
        sel = Selection(
            name="lr-sweep-1000",
            request={
                "name": "lr-sweep-1000",
                "base": SPEC,
                "space": SPACE,
                "method": "random",
                "trials": sizes.trials,
                "metric": "val_loss",
                "mode": "min",
            },
            status=JobStatus.running,
            metric="val_loss",
            mode="min",
            created_at=now - timedelta(hours=5),
            started_at=now - timedelta(hours=5),
            owner_id=owner,
        )
        s.add(sel)
        s.commit()
        params = [
            {
                "train.lr": 10 ** rng.uniform(-5, -2),
                "model.layers": rng.choice([2, 4, 6, 8]),
                "train.batch_size": rng.choice([8, 16, 32]),
                "train.weight_decay": rng.uniform(0.0, 0.1),
            }
            for _ in range(sizes.trials)
        ]
        # 80% ended (of which a third stopped early at a rung), 10% running, 10% queued
        states = [JobStatus.succeeded] * (sizes.trials * 8 // 10)
        states += [JobStatus.running] * (sizes.trials // 10)
        states += [JobStatus.queued] * (sizes.trials - len(states))
        jobs = [
            {
                "name": f"lr-sweep-1000/trial-{i}",
                "kind": "trial",
                "spec": SPEC,
                "status": str(st),
                "steps": sizes.trial_steps,
                "created_at": sel.created_at,
                "owner_id": owner,
                "selection_id": sel.id,
            }
            for i, st in enumerate(states)
        ]
        s.execute(insert(Job), jobs)
        job_ids = list(s.scalars(select(Job.id).where(Job.selection_id == sel.id).order_by(Job.id)))
        trials = []
        for i, (job_id, st, p) in enumerate(zip(job_ids, states, params, strict=True)):
            best = 0.5 + 3 * abs(math.log10(p["train.lr"]) + 3.3) / 3 + rng.uniform(0, 0.1)
            early = st == JobStatus.succeeded and i % 3 == 0
            done = sizes.trial_steps // 4 if early else sizes.trial_steps
            trials.append(
                {
                    "selection_id": sel.id,
                    "index": i,
                    "params": p,
                    "job_id": job_id,
                    "status": "stopped_early" if early else str(st),
                    "steps_done": 0 if st == JobStatus.queued else done,
                    "steps_total": sizes.trial_steps,
                    "last_metric": None if st == JobStatus.queued else best * 1.02,
                    "best_metric": None if st == JobStatus.queued else best,
                    "stopped_early": early,
                    "result": {"compute_s": rng.uniform(10, 60), "copy_s": rng.uniform(0, 2)}
                    if st == JobStatus.succeeded
                    else None,
                }
            )
        s.execute(insert(Trial), trials)
        s.commit()
        return sel.id, job_ids


def seed(url: str, sizes: Sizes, *, seed: int = 0, say: Any = print) -> Seeded:
    """Migrate `url` (an empty database) and fill it; returns what went in and how long it took."""
    rng = random.Random(seed)
    out = Seeded()
    upgrade(url)
    t = time.perf_counter()
    with session_for(url) as s:
        for i in range(sizes.users):
            out.users.append(create_user(s, name=f"user{i:02d}", max_running_jobs=1000, max_ranks=10_000).id)
        rows = list(_job_rows(sizes, out.users, rng))
        for k in range(0, len(rows), 10_000):
            s.execute(insert(Job), rows[k : k + 10_000])
        s.commit()
        ids = list(s.scalars(select(Job.id).where(Job.kind == "job").order_by(Job.id)))
    out.jobs = len(ids)
    out.seconds["jobs"] = time.perf_counter() - t
    say(f"  {out.jobs} jobs in {out.seconds['jobs']:.1f} s")

    t = time.perf_counter()
    out.selection_id, trial_jobs = _seed_selection(url, sizes=sizes, owner=out.users[0], rng=rng)
    out.trials = len(trial_jobs)
    out.seconds["trials"] = time.perf_counter() - t

    t = time.perf_counter()
    statuses = [r["status"] for r in rows]
    ended = [j for j, st in zip(ids, statuses, strict=True) if st in ("succeeded", "failed", "cancelled")]
    out.big_job_id = ended[-1]
    writer = _PointWriter(url)
    t0 = time.time() - 86_400
    for k, job_id in enumerate(trial_jobs):
        writer.add(_trial_points(job_id, sizes.trial_steps, t0, 1 + (k % 50) / 50))
    writer.add(_points_of(out.big_job_id, ("loss", "lr"), sizes.big_job_points // 2, t0))
    rest = sizes.points - writer.count - len(writer.buf)
    per = sizes.points_per_job // 2
    for job_id in ended[:-1]:
        if rest <= 0:
            break
        writer.add(_points_of(job_id, ("loss", "lr"), min(per, rest // 2), t0))
        rest -= 2 * min(per, rest // 2)
    writer.close()
    out.points = writer.count
    out.seconds["points"] = time.perf_counter() - t
    say(f"  {out.points} points in {out.seconds['points']:.1f} s")
    t = time.perf_counter()
    _analyze(url)
    out.seconds["analyze"] = time.perf_counter() - t
    return out


def _analyze(url: str) -> None:
    """PostgreSQL: fresh planner statistics and visibility map, as autovacuum keeps them on a
    database that grew over months. SQLite is left as the service leaves it (it never runs
    ANALYZE), so its planner works without statistics, as in production."""
    engine = get_engine(url)
    if engine.dialect.name == "sqlite":
        return
    raw = engine.raw_connection()
    try:
        conn = raw.dbapi_connection
        assert conn is not None
        conn.autocommit = True
        conn.cursor().execute("VACUUM ANALYZE")
        conn.autocommit = False
    finally:
        raw.close()
