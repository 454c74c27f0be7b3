"""Orders (a reservation's Celery task) that go missing, on the real stack: a redis-server, the API
with its scheduler, and Celery worker processes, each with its own data dir (two hosts without a
shared disk).

A worker that could have taken an order and never got it asks for it again (workers/intake.py):
the job runs within seconds, not after requeue_after_s (600 s, left at its default here). A worker
still starting asks nothing, so it gets no duplicate. An order that reaches a worker it was not
placed on is refused before anything touches that host's disk.

Worker `i` is killed with SIGKILL to stand for a worker whose consumer is gone or not yet up: with
SHARDYARD_WORKER_ALIVE_S at 600 s its heartbeat row still counts it alive, so the scheduler keeps
the order's reservation on it.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from api.stack import Stack
from core.broker import send_run_job
from core.settings import Settings
from db.connection import session_for
from db.models import Reservation
from tests.conftest import TINY_SPEC, StackHandle, running

pytestmark = pytest.mark.integration

LOST_ORDER_S = 2.0
HEARTBEAT_S = 0.5
ENV = {
    "SHARDYARD_HEARTBEAT_S": str(HEARTBEAT_S),
    "SHARDYARD_WORKER_ALIVE_S": "600",
    "SHARDYARD_LOST_ORDER_S": str(LOST_ORDER_S),
}
SPEC = {**TINY_SPEC, "train": {**TINY_SPEC["train"], "steps": 10}}


class Hosts:
    def __init__(self, root: Path) -> None:
        self.dirs = {i: root / f"host{i}" for i in (1, 2)}
        self.stack = Stack(
            root=root / "api",
            workers=0,
            concurrency=1,
            extra_env=ENV,
            worker_env={i: {"SHARDYARD_DATA_DIR": str(d)} for i, d in self.dirs.items()},
        )

    def down(self, i: int) -> None:
        """Worker i killed, its heartbeat row left to count it alive."""
        proc = self.stack.procs.pop(f"worker{i}", None)
        if proc is not None and proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()

    def up(self, i: int) -> None:
        proc = self.stack.procs.get(f"worker{i}")
        if proc is None or proc.poll() is not None:
            self.stack.start_worker(i)

    def log(self, i: int) -> str:
        return (self.stack.root / f"worker{i}.log").read_text(errors="replace")


@pytest.fixture(scope="module")
def hosts(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Hosts, StackHandle]]:
    h = Hosts(tmp_path_factory.mktemp("lost-orders"))
    with running(h.stack) as handle:
        h.up(1)  # worker1's heartbeat row: the scheduler places on it from now on, alive or not
        yield h, handle


def _reservation(st: Stack, job_id: int, timeout: float = 60) -> Reservation:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with session_for(st.database_url) as s:
            row = s.query(Reservation).filter_by(job_id=job_id).first()
            if row is not None and row.sent_at is not None:
                s.expunge(row)
                return row
        time.sleep(0.2)
    raise AssertionError(f"job {job_id} was not placed within {timeout}s")


def _queued_orders(st: Stack, worker: str) -> int:
    """Messages waiting in `worker`'s own queue in redis-server (kombu keeps a queue as a list
    named after it)."""
    broker = redis.Redis.from_url(st.broker_url)
    try:
        return sum(broker.llen(k) for k in broker.keys(f"node.{worker}*") if broker.type(k) == b"list")
    finally:
        broker.close()


def _logs(h: StackHandle, job_id: int) -> list[str]:
    items = h.client.get(f"/api/jobs/{job_id}/logs", params={"limit": 1000}).json()["items"]
    return [e["message"] for e in items]


def _run_job_lines(text: str, since: int) -> list[str]:
    return [ln for ln in text[since:].splitlines() if "shardyard.run_job[" in ln]


def test_a_worker_still_starting_gets_no_duplicate(hosts: tuple[Hosts, StackHandle]) -> None:
    """The order waits in the queue of a worker whose consumer is not up, for many times
    lost_order_s: nothing sends it again; the worker, once started, takes the one order."""
    hs, h = hosts
    hs.down(1)
    job_id = h.submit({**SPEC, "name": "starting"})["id"]
    row = _reservation(hs.stack, job_id)
    worker = row.worker
    assert worker.startswith("worker1@")
    time.sleep(4 * LOST_ORDER_S + 2 * HEARTBEAT_S)
    with session_for(hs.stack.database_url) as s:
        again = s.get(Reservation, row.id)
        assert again is not None and again.claimed_at is None
        assert again.sent_at == row.sent_at, "the order was sent again to a worker that was not up"
    assert _queued_orders(hs.stack, worker) == 1

    since = len(hs.log(1))
    hs.up(1)
    h.wait(job_id, timeout=180)
    # a duplicate would have come to this worker too, and been skipped after the job's end
    time.sleep(LOST_ORDER_S + 2 * HEARTBEAT_S)
    lines = _run_job_lines(hs.log(1), since)
    assert len([ln for ln in lines if " received" in ln]) == 1, lines
    assert not any("sent again" in m for m in _logs(h, job_id))
    assert _queued_orders(hs.stack, worker) == 0


def test_a_lost_order_is_sent_again_within_seconds(hosts: tuple[Hosts, StackHandle]) -> None:
    """The order is deleted from redis-server before its worker consumes it (as a broker that
    restarted empty, or a message stranded with a dead pool process, loses it). The worker, up and
    free, asks for it again and the job runs, long before requeue_after_s (600 s)."""
    hs, h = hosts
    hs.down(1)
    job_id = h.submit({**SPEC, "name": "lost"})["id"]
    row = _reservation(hs.stack, job_id)
    broker = redis.Redis.from_url(hs.stack.broker_url)
    try:
        keys = [k for k in broker.keys(f"node.{row.worker}*") if broker.type(k) == b"list"]
        assert sum(broker.llen(k) for k in keys) == 1
        broker.delete(*keys)  # the order is lost
    finally:
        broker.close()
    hs.up(1)
    done = h.wait(job_id, timeout=120)
    assert done["attempts"] == 1
    logs = _logs(h, job_id)
    assert any(m.startswith(f"its order never reached {row.worker}") and "sent again" in m for m in logs), (
        logs
    )


def test_no_folder_on_a_host_whose_claim_is_refused(hosts: tuple[Hosts, StackHandle]) -> None:
    """A job reserved on worker1 (host 1); its order also reaches worker2 (host 2), as a
    duplicate addressed elsewhere would. Worker2 refuses it before touching its disk; the job runs
    on host 1."""
    hs, h = hosts
    hs.down(1)
    hs.down(2)
    job_id = h.submit({**SPEC, "name": "elsewhere"})["id"]
    row = _reservation(hs.stack, job_id)
    assert row.worker.startswith("worker1@")
    other = "worker2@" + row.worker.split("@", 1)[1]
    settings = Settings(database_url=hs.stack.database_url, broker_url=hs.stack.broker_url)
    send_run_job(settings, job_id=job_id, queue=f"node.{other}")
    since = len(hs.log(2)) if (hs.stack.root / "worker2.log").exists() else 0
    hs.up(2)
    deadline = time.monotonic() + 120
    while not any("succeeded in" in ln for ln in _run_job_lines(hs.log(2), since)):
        assert time.monotonic() < deadline, hs.log(2)[-3000:]
        time.sleep(0.2)
    (ended,) = [ln for ln in _run_job_lines(hs.log(2), since) if "succeeded in" in ln]
    assert ended.rstrip().endswith("'skipped'"), ended
    assert not (hs.dirs[2] / "jobs" / str(job_id)).exists(), "a folder on the host that refused it"

    hs.up(1)
    h.wait(job_id, timeout=180)
    assert (hs.dirs[1] / "jobs" / str(job_id)).is_dir()
    assert not (hs.dirs[2] / "jobs" / str(job_id)).exists()
