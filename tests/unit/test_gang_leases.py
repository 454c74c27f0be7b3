"""The leases and fencing of a job on several nodes (db/gangs.py), against real SQLite
and real PostgreSQL: node 0 holds the job's lease, the other nodes their reservation's; any of them
may write the job's lines for its attempt, nobody else may; the gang is given back whole."""

from __future__ import annotations

import time

from sqlalchemy import select
from sqlalchemy.orm import Session

from db import gangs as dbg
from db import ingest as dbi
from db import jobs as dbj
from db.connection import session_for
from db.models import Job, MetricPoint, Reservation


def _gang(url: str, *, nnodes: int = 2, attempt: int = 0) -> int:
    """A job the scheduler placed on workers w0..w{n-1}, two slots each (what db/scheduling.py
    writes: one reservation per node, made at the job's attempts counter)."""
    with session_for(url) as s:
        job = dbj.create_job(s, name="g", spec={"train": {"steps": 9}}, steps=9, world_size=2 * nnodes)
        s.get(Job, job.id).nnodes = nnodes
        for r in range(nnodes):
            s.add(
                Reservation(
                    job_id=job.id, worker=f"w{r}", node_rank=r, nnodes=nnodes, slots=2, attempt=attempt
                )
            )
        s.commit()
        return job.id


def _start(url: str, job_id: int, *, lease_s: float = 30) -> list[dbj.Attempt]:
    """Node 1 claims first (the task order is the broker's), then node 0 takes the job's lease."""
    with session_for(url) as s:
        member = dbg.claim_node(s, job_id=job_id, node_rank=1, worker="w1", owner="p1", lease_s=lease_s)
        head = dbj.claim_job(s, job_id=job_id, owner="p0", worker="w0", lease_s=lease_s)
        mine = dbg.claim_node(s, job_id=job_id, node_rank=0, worker="w0", owner="p0", lease_s=lease_s)
    assert member is not None and head is not None and mine == head
    assert member.attempt == head.attempt
    return [head, member]


def _write(url: str, attempt: dbj.Attempt, node_rank: int, lines: dbi.JobLines) -> dbi.Applied | None:
    with session_for(url) as s:
        got = dbg.apply_gang_lines(
            s, attempt=attempt, node_rank=node_rank, lines=lines, lease_s=30, now=dbj.db_now(s)
        )
        s.commit()
        return got


def _losses(url: str, job_id: int) -> list[tuple[int, float]]:
    with session_for(url) as s:
        q = select(MetricPoint.step, MetricPoint.value).where(
            MetricPoint.job_id == job_id, MetricPoint.name == "loss"
        )
        return [tuple(r) for r in s.execute(q.order_by(MetricPoint.step))]


def _loss(seq: int, step: int, value: float) -> dbi.JobLines:
    return dbi.JobLines(metrics=[(seq, step, "loss", value, 1.0)])


def test_only_a_node_placed_there_claims_and_only_once(db_url: str) -> None:
    job_id = _gang(db_url)
    with session_for(db_url) as s:
        # the scheduler put node 1 on w1: a task for it delivered to w0 does nothing
        assert dbg.claim_node(s, job_id=job_id, node_rank=1, worker="w0", owner="px", lease_s=30) is None
        got = dbg.claim_node(s, job_id=job_id, node_rank=1, worker="w1", owner="p1", lease_s=30)
        assert got == dbj.Attempt(job_id=job_id, attempt=1, owner="p1")
        # a second delivery of the same message, to another process of w1: taken
        assert dbg.claim_node(s, job_id=job_id, node_rank=1, worker="w1", owner="p2", lease_s=30) is None
        # a retry of p1's own task takes it again
        assert dbg.claim_node(s, job_id=job_id, node_rank=1, worker="w1", owner="p1", lease_s=30) == got


def test_any_node_of_the_attempt_writes_the_lines_nobody_else(db_url: str) -> None:
    job_id = _gang(db_url)
    head, member = _start(db_url, job_id)
    # the node holding global rank 0 (here node 1) writes the lines; node 0 only renews, and its
    # renewal between the member's batches never looks like a fence
    assert _write(db_url, member, 1, _loss(0, 1, 3.0)) is not None
    assert _write(db_url, head, 0, dbi.JobLines()) is not None
    assert _write(db_url, member, 1, _loss(1, 2, 2.5)) is not None
    assert _write(db_url, head, 0, dbi.JobLines()) is not None
    # a process with no reservation, or a stale owner id, writes nothing
    stranger = dbj.Attempt(job_id=job_id, attempt=head.attempt, owner="p9")
    assert _write(db_url, stranger, 1, _loss(2, 3, 9.0)) is None
    assert _losses(db_url, job_id) == [(1, 3.0), (2, 2.5)]
    with session_for(db_url) as s:
        assert dbg.gang_view(s, attempt=member, node_rank=1).intact


def _give_back(s: Session, writer: dbj.Attempt, *, reason: str, gang_restarts: int) -> str | None:
    """`writer`'s node gives its gang back, to be restarted (up to `gang_restarts`)."""
    return dbg.give_back_gang(
        s,
        job_id=writer.job_id,
        attempt=writer.attempt,
        reason=reason,
        restart=True,
        gang_restarts=gang_restarts,
        writer=writer,
    )


def test_a_node_giving_the_gang_back_fences_every_node(db_url: str) -> None:
    job_id = _gang(db_url)
    head, member = _start(db_url, job_id)
    with session_for(db_url) as s:
        # node 0's trainer failed (a peer's sockets closed): the whole gang goes back
        status = _give_back(s, head, reason="node 0: gloo", gang_restarts=3)
        assert status == "queued"
        job = dbj.get_job(s, job_id)
        assert (job.status, job.owner) == ("queued", None)
        assert s.scalars(select(Reservation).where(Reservation.job_id == job_id)).all() == []
        assert dbg.gang_restarts_used(s, job_id=job_id) == 1
        assert not dbg.gang_view(s, attempt=member, node_rank=1).intact
        # the survivor cannot give it back twice, nor write, nor renew
        assert _give_back(s, member, reason="x", gang_restarts=3) is None
        assert not dbg.renew_node(s, attempt=member, node_rank=1, lease_s=30)
    assert _write(db_url, member, 1, _loss(5, 6, 1.0)) is None
    assert _losses(db_url, job_id) == []


def test_past_gang_restarts_the_job_fails_with_the_reason(db_url: str) -> None:
    job_id = _gang(db_url)
    for n in range(3):
        with session_for(db_url) as s:
            attempts = dbj.get_job(s, job_id).attempts
            for r in range(2 if n else 0):  # the scheduler places it again
                s.add(
                    Reservation(
                        job_id=job_id, worker=f"w{r}", node_rank=r, nnodes=2, slots=2, attempt=attempts
                    )
                )
            s.commit()
        head, _ = _start(db_url, job_id)
        with session_for(db_url) as s:
            status = _give_back(s, head, reason=f"lost {n}", gang_restarts=2)
        assert status == ("queued" if n < 2 else "failed")
    with session_for(db_url) as s:
        job = dbj.get_job(s, job_id)
        assert job.status == "failed"
        assert job.error == "the gang failed 3 times (gang_restarts=2); last: lost 2"


def test_a_nodes_lease_running_out_gives_the_gang_back(db_url: str) -> None:
    job_id = _gang(db_url)
    head, member = _start(db_url, job_id, lease_s=30)
    with session_for(db_url) as s:
        # node 1's worker died: it stops renewing; only its own lease is short here
        dbg.renew_node(s, attempt=member, node_rank=1, lease_s=0.1)
    time.sleep(0.3)
    with session_for(db_url) as s:
        requeued, cancelled = dbg.expire_gangs(s, now=dbj.db_now(s), gang_restarts=3)
        assert [j.id for j in requeued] == [job_id] and cancelled == []
        job = dbj.get_job(s, job_id)
        assert job.status == "queued"
        reason = dbi.last_status_event(s, job_id=job_id).data["reason"]
        assert reason == f"the lease of node 1 on w1 (attempt {head.attempt}) ran out"
        # the surviving node 0 is fenced off: its poll kills its trainer
        assert not dbg.gang_view(s, attempt=head, node_rank=0).intact
    assert _write(db_url, head, 0, _loss(0, 1, 1.0)) is None
