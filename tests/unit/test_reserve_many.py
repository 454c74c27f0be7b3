"""db/scheduling.py reserve_many: a tick's jobs reserved in one transaction decide exactly as
`reserve` called for each in turn (capacity and quotas counted job after job, what the database
already holds, running jobs without a reservation), on SQLite and PostgreSQL; and a reservation
another scheduler slipped in sends each job back through `reserve`."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import select, update

from db import jobs as dbj
from db import scheduling as dbs
from db.connection import session_for
from db.migrate import upgrade
from db.models import Job, JobStatus, Reservation
from db.users import create_user

GiB = 2**30
SPEC = {
    "model": {"kind": "gpt", "layers": 1, "d_model": 16, "heads": 1, "seq_len": 8, "vocab_size": 64},
    "train": {"steps": 1, "batch_size": 2},
}
WORKERS = ["w1@h", "w2@h", "w3@h"]


def _world(url: str, rng: random.Random) -> tuple[list[int], dict[str, dbs.Capacity], list[dbs.Ask]]:
    """Users with quotas, queued jobs, some reserved already, one running without a reservation,
    one cancelled; and asks over them: some over a worker's room, some over a quota, one job asked
    twice, gangs among them. The same `rng` state writes the same world."""
    with session_for(url) as s:
        users = [create_user(s, name=f"u{i}").id for i in range(3)]
        jobs = [
            dbj.create_job(
                s, name="j", spec=SPEC, owner_id=rng.choice(users), world_size=rng.choice([1, 1, 2, 4])
            ).id
            for _ in range(24)
        ]
    capacity = {
        w: dbs.Capacity(slots=rng.randint(2, 6), tasks=rng.randint(1, 4), gpus=0, ram_bytes=64 * GiB)
        for w in WORKERS
    }
    with session_for(url) as s:  # what the database holds before: two reservations, a loose runner
        assert dbs.reserve(s, job_id=jobs[0], nodes=[dbs.Node("w1@h", 1, 0, GiB)], capacity=capacity)
        assert dbs.reserve(s, job_id=jobs[1], nodes=[dbs.Node("w2@h", 1, 0, GiB)], capacity=capacity)
        s.execute(update(Job).where(Job.id == jobs[2]).values(status=JobStatus.running, worker="w3@h"))
        s.execute(update(Job).where(Job.id == jobs[3]).values(cancel_requested=True))
        s.commit()
        owners = dict(s.execute(select(Job.id, Job.owner_id).where(Job.id.in_(jobs))).all())
        sizes = dict(s.execute(select(Job.id, Job.world_size).where(Job.id.in_(jobs))).all())
    limits = {u: {"running_jobs": rng.randint(1, 4), "ranks": rng.randint(2, 8), "gpus": 8} for u in users}
    asks = []
    for j in [*jobs[:4], *rng.sample(jobs[4:], 16), jobs[5]]:
        n = rng.choice([1, 1, 2]) if sizes[j] > 1 else 1
        nodes = [dbs.Node(w, sizes[j] // n, 0, GiB) for w in rng.sample(WORKERS, n)]
        asks.append(dbs.Ask(j, nodes, limits[owners[j]] if rng.random() < 0.7 else None))
    return jobs, capacity, asks


def _held(url: str) -> list[tuple[Any, ...]]:
    with session_for(url) as s:
        return sorted(
            tuple(r)
            for r in s.execute(
                select(
                    Reservation.job_id,
                    Reservation.worker,
                    Reservation.node_rank,
                    Reservation.nnodes,
                    Reservation.slots,
                    Reservation.attempt,
                )
            )
        )


@pytest.mark.parametrize("seed", range(6))
def test_one_transaction_decides_as_one_reserve_per_job(db_url: str, tmp_path: Path, seed: int) -> None:
    ref = f"sqlite:///{tmp_path / 'ref.db'}"
    upgrade(ref)
    _, cap, asks = _world(ref, random.Random(seed))
    _, cap2, asks2 = _world(db_url, random.Random(seed))
    assert (cap, asks) == (cap2, asks2)
    expected: dict[int, list[tuple[str, int]]] = {}
    with session_for(ref) as s:
        for a in asks:
            rows = dbs.reserve(s, job_id=a.job_id, nodes=a.nodes, capacity=cap, quota=a.quota)
            if rows is not None:
                expected[a.job_id] = [(r.worker, r.node_rank) for r in rows]
    with session_for(db_url) as s:
        got = dbs.reserve_many(s, asks=asks, capacity=cap)
        assert not s.in_transaction()
    assert {j: [(r.worker, r.node_rank) for r in rows] for j, rows in got.items()} == expected
    assert _held(db_url) == _held(ref)
    with session_for(db_url) as s:  # each job taken: its reason cleared, its node count written
        for j, rows in got.items():
            job = s.get(Job, j)
            assert job is not None and job.wait_reason is None and job.nnodes == len(rows)
            assert job.enqueued_at is not None


def test_a_reservation_slipped_in_sends_each_job_through_reserve(
    db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another scheduler's reservation of one of the jobs, committed after this transaction read
    the jobs (simulated: the read no longer leaves reserved jobs out), fails the batch's insert;
    every other job is still reserved, the taken one is not reserved twice."""
    with session_for(db_url) as s:
        jobs = [dbj.create_job(s, name="j", spec=SPEC).id for _ in range(3)]
    cap = {"w1@h": dbs.Capacity(slots=8, tasks=8, gpus=0, ram_bytes=64 * GiB)}
    with session_for(db_url) as s:
        assert dbs.reserve(s, job_id=jobs[1], nodes=[dbs.Node("w1@h", 1, 0, 0)], capacity=cap)
    monkeypatch.setattr(
        dbs,
        "_FREE_JOBS",
        select(Job.id, Job.attempts, Job.owner_id).where(
            Job.id.in_(dbs.bindparam("jobs", expanding=True)), Job.status == JobStatus.queued
        ),
    )
    with session_for(db_url) as s:
        got = dbs.reserve_many(s, asks=[dbs.Ask(j, [dbs.Node("w1@h", 1, 0, 0)]) for j in jobs], capacity=cap)
    assert sorted(got) == [jobs[0], jobs[2]]
    assert [r[0] for r in _held(db_url)] == jobs
