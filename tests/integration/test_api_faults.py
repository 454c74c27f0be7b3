"""The API under load and faults, on its own stack (redis-server + uvicorn, no worker): open streams
hold no database connection and are capped per client; a database write lock held by another
process and a stopped or hung redis-server are answered 503 with the reason, or served degraded, never a
hang or a 500; finished jobs are deleted on request and by the retention cleanup."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import httpx
import pytest
from sqlalchemy import func, select, update

from api.stack import Stack
from db.connection import session_for
from db.ingest import add_event
from db.jobs import Attempt, claim_job, create_job, finish_job
from db.models import Job, JobEvent, JobStatus, MetricPoint, utcnow
from tests.conftest import TINY_SPEC

pytestmark = pytest.mark.integration

STREAM_CAP = 40
RETENTION_DAYS = 1.0


@pytest.fixture(scope="module")
def api_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    root = tmp_path_factory.mktemp("faults")
    st = Stack(
        root=root,
        workers=0,
        extra_env={
            "SHARDYARD_SSE_MAX_PER_CLIENT": str(STREAM_CAP),
            "SHARDYARD_SSE_KEEPALIVE_S": "1",
            "SHARDYARD_JOB_RETENTION_DAYS": str(RETENTION_DAYS),
            "SHARDYARD_RETENTION_CHECK_S": "0.5",
        },
    )
    st.start()
    try:
        yield st
    finally:
        st.stop()


def _client(st: Stack, timeout: float) -> httpx.Client:
    """Signed in as the stack's admin."""
    return httpx.Client(
        base_url=st.base_url, timeout=timeout, headers={"Authorization": f"Bearer {st.admin_token}"}
    )


def _queued_job(st: Stack, name: str = "idle") -> int:
    """A job row whose message is never sent: it stays queued, so its stream stays open."""
    with session_for(st.database_url) as s:
        return create_job(s, name=name, spec=TINY_SPEC, steps=1).id


def _open_stream(st: Stack, path: str) -> tuple[socket.socket, bytes]:
    """A raw HTTP/1.1 stream request; returns the socket (kept open) and the response head."""
    sock = socket.create_connection(("127.0.0.1", st.api_port), timeout=30)
    auth = f"Authorization: Bearer {st.admin_token}\r\n"
    sock.sendall(
        f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n{auth}Accept: text/event-stream\r\n\r\n".encode()
    )
    buf = b""
    while b"\r\n\r\n" not in buf:
        chunk = sock.recv(4096)
        assert chunk, f"{path}: connection closed before the response head"
        buf += chunk
    if buf.startswith(b"HTTP/1.1 200"):
        while b"retry:" not in buf:  # the stream's first frame: its generator is running
            chunk = sock.recv(4096)
            assert chunk, f"{path}: stream closed early"
            buf += chunk
    return sock, buf


def test_open_streams_hold_no_db_connection_and_are_capped(api_stack: Stack) -> None:
    st = api_stack
    job_ids = [_queued_job(st) for _ in range(4)]
    paths = [f"/api/jobs/{job_ids[i % 4]}/stream" for i in range(STREAM_CAP - 2)] + ["/api/events"] * 2
    socks = []
    try:
        for p in paths:
            sock, head = _open_stream(st, p)
            socks.append(sock)
            assert head.startswith(b"HTTP/1.1 200"), head[:200]
        with _client(st, 30) as c:
            # the pool keeps 20 connections (db/connection.py SQLITE_POOL_SIZE): 40 streams that
            # each pinned one would hold more than it keeps, and the requests would wait on them
            pool = c.get("/api/health").json()["db"]["pool"]
            assert pool["checked_out"] < pool["size"], pool
            listing = c.get("/api/jobs", params={"limit": 5})
            assert listing.status_code == 200, listing.text
            assert listing.json()["total"] >= 4
            one = c.get(f"/api/jobs/{job_ids[0]}")
            assert one.status_code == 200 and one.json()["status"] == "queued"
            # one stream past the cap is refused with the reason
            over = c.get(f"/api/jobs/{job_ids[0]}/stream")
            assert over.status_code == 429, over.text
            assert "too many open streams" in over.json()["detail"]
            assert str(STREAM_CAP) in over.json()["detail"]
            # a closed stream gives its slot back
            socks.pop().close()
            deadline = time.monotonic() + 30
            while True:
                sock, head = _open_stream(st, f"/api/jobs/{job_ids[1]}/stream")
                if head.startswith(b"HTTP/1.1 200"):
                    socks.append(sock)
                    break
                sock.close()
                assert time.monotonic() < deadline, "the closed stream's slot was never released"
                time.sleep(0.2)
    finally:
        for sock in socks:
            sock.close()


def _hold_write_lock(db_path: Path) -> subprocess.Popen[str]:
    """Another process takes SQLite's write lock (BEGIN IMMEDIATE) and keeps it until its stdin
    closes (at most 60 s)."""
    code = (
        "import sqlite3, sys, select\n"
        f"c = sqlite3.connect({str(db_path)!r}, isolation_level=None)\n"
        "c.execute('BEGIN IMMEDIATE')\n"
        "print('locked', flush=True)\n"
        "select.select([sys.stdin], [], [], 60)\n"
        "c.execute('ROLLBACK')\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None and proc.stdout.readline().strip() == "locked"
    return proc


def test_database_write_lock_answers_503_with_the_reason(api_stack: Stack) -> None:
    st = api_stack
    job_id = _queued_job(st)
    locker = _hold_write_lock(st.root / "shardyard.db")
    try:
        with _client(st, 60) as c:
            # reads go on under WAL while another process holds the write lock
            assert c.get("/api/jobs").status_code == 200
            assert c.get(f"/api/jobs/{job_id}").status_code == 200
            # a write waits out the busy timeout, then answers 503 naming the cause (the client's
            # 60 s timeout would fail this test if the request hung)
            r = c.post("/api/jobs", json=TINY_SPEC)
            assert r.status_code == 503, r.text
            assert "database is locked" in r.json()["detail"]
            assert r.headers["retry-after"]
            r = c.post(f"/api/jobs/{job_id}/cancel")
            assert r.status_code == 503 and "database is locked" in r.json()["detail"], r.text
        # the waits were explained in the API's log as they happened (api/stalls.py): the waiting
        # request, a loop that still turns, and the request thread's stack inside SQLite's execute
        # (the first report naming the submit: a loaded machine may have reported a slow request
        # of an earlier test first)
        reports = (st.root / "api.log").read_text(errors="replace").split("request(s) waiting over")[1:]
        assert reports, "no stall report in the API's log"
        posts = [r for r in reports if "POST /api/jobs" in r.split("Every thread now")[0]]
        assert posts, reports[0][:3000]
        assert "the event loop turns" in posts[0]
        assert re.search(r"sqlalchemy/engine/default\.py.*\n.*cursor\.execute", posts[0]), posts[0][:3000]
    finally:
        assert locker.stdin is not None
        locker.stdin.close()
        locker.wait(timeout=30)
    with _client(st, 60) as c:
        assert c.post("/api/jobs", json=TINY_SPEC).status_code == 201


def test_broker_down_is_served_or_answered_503_never_500(api_stack: Stack) -> None:
    st = api_stack
    job_id = _queued_job(st)
    st.stop_process("redis")
    try:
        with _client(st, 60) as c:
            health = c.get("/api/health").json()
            assert health["status"] == "degraded" and health["broker"]["ok"] is False
            # a submit is accepted without the broker: the job is in the database, and the
            # scheduler sends its task once it is placed (this stack has no worker: it waits)
            r = c.post("/api/jobs", json=TINY_SPEC)
            assert r.status_code == 201, r.text
            assert c.get(f"/api/jobs/{r.json()['id']}").json()["status"] == "queued"
            # so is a selection: its trials are queued, and the scheduler sends their groups
            sel = {"name": "s", "base": TINY_SPEC, "space": {"train.lr": [0.001, 0.002]}, "trials": 2}
            r = c.post("/api/selections", json=sel)
            assert r.status_code == 201, r.text
            assert [t["status"] for t in r.json()["trials"]] == ["queued", "queued"]
            # a stream still opens and serves what the database has
            _stream_opens_queued(c, job_id)
    finally:
        st.start_redis()


def _stream_opens_queued(c: httpx.Client, job_id: int) -> None:
    """The job's stream opens and its first frame is the queued job the database has."""
    with c.stream("GET", f"/api/jobs/{job_id}/stream", timeout=httpx.Timeout(10, read=30)) as s:
        assert s.status_code == 200
        for line in s.iter_lines():
            if line.startswith("data:"):
                assert '"queued"' in line
                break


def _running_job(st: Stack, name: str) -> tuple[int, Attempt]:
    job_id = _queued_job(st, name)
    with session_for(st.database_url) as s:
        attempt = claim_job(s, job_id=job_id, owner=f"test-{job_id}", worker="test", lease_s=3600)
    assert attempt is not None
    return job_id, attempt


def test_a_hung_broker_never_hangs_the_api(api_stack: Stack) -> None:
    """redis-server stopped with SIGSTOP: it accepts connections and answers nothing. Every call
    to it must time out instead of waiting forever (the client's 60 s timeout fails a hang)."""
    st = api_stack
    job_id = _queued_job(st)
    redis = st.procs["redis"]
    os.kill(redis.pid, signal.SIGSTOP)
    try:
        with _client(st, 60) as c:
            health = c.get("/api/health").json()
            assert health["status"] == "degraded" and health["broker"]["ok"] is False, health
            r = c.post("/api/jobs", json=TINY_SPEC)
            assert r.status_code == 201, r.text
            _stream_opens_queued(c, job_id)
            assert c.post(f"/api/jobs/{job_id}/cancel").json()["status"] == "cancelled"
    finally:
        os.kill(redis.pid, signal.SIGCONT)


def _finished_job(st: Stack, *, finished_ago: timedelta, points: int = 3) -> int:
    """Events: queued, running, one log line, succeeded."""
    job_id, attempt = _running_job(st, "done")
    with session_for(st.database_url) as s:
        s.add_all(MetricPoint(job_id=job_id, step=i, name="loss", value=1.0, time=0.0) for i in range(points))
        s.commit()
        add_event(s, job_id=job_id, kind="log", message="hello")
        assert finish_job(s, attempt=attempt, status=JobStatus.succeeded) is not None
        s.execute(update(Job).where(Job.id == job_id).values(finished_at=utcnow() - finished_ago))
        s.commit()
    folder = st.root / "jobs" / str(job_id) / "checkpoints"
    folder.mkdir(parents=True)
    (folder / "step-00000001.pt").write_bytes(b"x" * 100)
    return job_id


def _rows(st: Stack, job_id: int) -> tuple[int, int, int]:
    with session_for(st.database_url) as s:
        return (
            s.scalar(select(func.count()).where(Job.id == job_id)) or 0,
            s.scalar(select(func.count()).where(MetricPoint.job_id == job_id)) or 0,
            s.scalar(select(func.count()).where(JobEvent.job_id == job_id)) or 0,
        )


def test_delete_finished_job_and_refuse_unfinished(api_stack: Stack) -> None:
    st = api_stack
    running, _ = _running_job(st, "running")
    done = _finished_job(st, finished_ago=timedelta(0))
    assert _rows(st, done) == (1, 3, 4)
    with _client(st, 30) as c:
        r = c.delete(f"/api/jobs/{running}")
        assert r.status_code == 409 and "is running" in r.json()["detail"], r.text
        assert _rows(st, running)[0] == 1
        r = c.delete(f"/api/jobs/{done}")
        assert r.status_code == 204, r.text
        assert _rows(st, done) == (0, 0, 0)
        assert not (st.root / "jobs" / str(done)).exists()
        assert c.get(f"/api/jobs/{done}").status_code == 404
        r = c.delete(f"/api/jobs/{done}")
        assert r.status_code == 404 and f"job {done} does not exist" in r.json()["detail"]


def test_retention_cleanup_deletes_only_old_finished_jobs(api_stack: Stack) -> None:
    st = api_stack
    old = _finished_job(st, finished_ago=timedelta(days=2 * RETENTION_DAYS))
    recent = _finished_job(st, finished_ago=timedelta(days=RETENTION_DAYS / 2))
    queued = _queued_job(st, "old-but-queued")
    with session_for(st.database_url) as s:
        s.execute(update(Job).where(Job.id == queued).values(created_at=utcnow() - timedelta(days=3)))
        s.commit()
    deadline = time.monotonic() + 60
    # the API's cleanup runs every 0.5 s; it deletes the rows, then the folder (api/retention.py)
    while _rows(st, old)[0] or (st.root / "jobs" / str(old)).exists():
        assert time.monotonic() < deadline, "the retention cleanup never deleted the old job"
        time.sleep(0.2)
    assert _rows(st, old) == (0, 0, 0)
    assert _rows(st, recent) == (1, 3, 4) and (st.root / "jobs" / str(recent)).exists()
    assert _rows(st, queued)[0] == 1
