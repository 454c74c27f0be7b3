"""Why the process running an attempt was lost (workers/lost.py), read from real processes and a
real full disk, and recorded for whoever takes its lease back (db/jobs.py take_back) to say."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest
from sqlalchemy import update

from core.settings import Settings
from db import ingest as dbi
from db import jobs as dbj
from db.connection import session_for
from db.models import Job
from jobrules.restarts import max_restarts
from tests.fullfs import full_disk
from workers import lost


def test_a_killed_child_is_read_as_a_zombie_before_it_is_reaped() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert lost.zombie_status(child.pid) is None  # alive
        os.kill(child.pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while (status := lost.zombie_status(child.pid)) is None:
            assert time.monotonic() < deadline, "the killed child never showed as a zombie"
            time.sleep(0.01)
        assert lost.death_cause(status) == "the worker process running it was killed (signal 9)"
    finally:
        child.kill()
        child.wait()  # reaped only now: the status was read, not taken
    assert lost.zombie_status(child.pid) is None
    assert lost.process_death("signal 9 (SIGKILL)") == "the worker process running it was killed (signal 9)"
    assert lost.death_cause(3 << 8) == "the worker process running it exited with code 3"


def _enospc(tmp_path: Path) -> OSError:
    """The error of a write past a real full disk (a tiny tmpfs)."""
    try:
        with full_disk(tmp_path / "disk", size_kib=16) as where:
            try:
                (where / "big").write_bytes(b"\0" * (64 << 10))
            except OSError as e:
                return e
    except RuntimeError as e:
        pytest.skip(f"no full disk to inject here: {e}")
    raise AssertionError("the write fitted")


def test_a_full_disk_is_recorded_and_becomes_the_restart_reason(db_url: str, tmp_path: Path) -> None:
    err = _enospc(tmp_path)
    wrapped = RuntimeError("could not write the spec")  # found through the exception's chain
    wrapped.__cause__ = err
    cause = lost.disk_full(wrapped)
    assert cause is not None and cause.startswith("the data disk was full (OSError: [Errno 28]"), cause
    assert lost.disk_full(ValueError("bad spec")) is None
    assert lost.disk_full("database writes failed for 5s: database or disk is full").startswith(
        lost.DISK_FULL
    )

    with session_for(db_url) as s:
        job_id = dbj.create_job(s, name="j", spec={"max_restarts": 2}, steps=9).id
        owner = f"{lost.owner_prefix(os.getpid())}abc"
        dbj.claim_job(s, job_id=job_id, owner=owner, worker="w", lease_s=60)
    settings = Settings(database_url=db_url)
    assert lost.record(settings, worker="w", owner=lost.owner_prefix(os.getpid()), cause=cause) == [job_id]
    assert lost.record(settings, worker=None, owner=owner, cause=cause) == [job_id]  # said once
    with session_for(db_url) as s:
        s.execute(
            update(Job).where(Job.id == job_id).values(lease_until=dbj.db_now(s) - timedelta(seconds=1))
        )
        s.commit()
        requeued, _ = dbj.expire_leases(s, max_restarts=max_restarts)
        assert [j.id for j in requeued] == [job_id]
        events = dbi.events_after(s, job_id=job_id, after_id=0)
    assert [e.kind for e in events].count(dbj.LOST_EVENT) == 1
    (restart,) = [e.data for e in events if e.kind == "status" and (e.data or {}).get("restart")]
    assert restart["reason"] == f"w: {cause}" and restart["restart"] == 1
