"""The API's embedded scheduler in its own process (core/scheduler_proc.py): it ticks against the
database, and however it is stopped (asked, its parent's pipe closing, SIGTERM) it exits and
hands the scheduler lock back, so the next API's scheduler need not wait for the lease."""

from __future__ import annotations

import signal
import time
from collections.abc import Callable
from pathlib import Path

from sqlalchemy import select

from core.scheduler_proc import SchedulerProcess
from core.settings import Settings
from db import jobs as dbj
from db.connection import session_for
from db.migrate import upgrade
from db.models import Job, SchedulerLock

SPEC = {
    "model": {"kind": "gpt", "layers": 1, "d_model": 16, "heads": 1, "seq_len": 8, "vocab_size": 64},
    "train": {"steps": 1, "batch_size": 2},
}


def _until(what: str, check: Callable[[], bool], timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"never: {what}"
        time.sleep(0.1)


def _holder(url: str) -> str | None:
    with session_for(url) as s:
        return s.scalar(select(SchedulerLock.holder).where(SchedulerLock.name == "scheduler"))


def _started(tmp_path: Path) -> tuple[str, SchedulerProcess]:
    url = f"sqlite:///{tmp_path / 'test.db'}"
    upgrade(url)
    # no broker is needed: with no worker alive nothing is placed, so nothing is sent
    settings = Settings(database_url=url, broker_url="redis://127.0.0.1:1/0", scheduler_s=0.2)
    sched = SchedulerProcess(settings).start()
    assert sched.proc is not None
    pid = sched.proc.pid
    _until("the child holds the lock", lambda: f":{pid}:" in (_holder(url) or ""))
    return url, sched


def test_child_ticks_and_a_stop_releases_the_lock(tmp_path: Path) -> None:
    url, sched = _started(tmp_path)
    with session_for(url) as s:
        job_id = dbj.create_job(s, name="j", spec=SPEC, world_size=1).id
    sched.wake()

    def reason() -> str | None:
        with session_for(url) as s:
            return s.get(Job, job_id).wait_reason  # type: ignore[union-attr]

    _until("the child's tick wrote the job's wait reason", lambda: reason() is not None)
    assert reason() == "no live worker: waiting for one to start"
    sched.stop()
    assert sched.proc is not None and sched.proc.returncode == 0
    assert _holder(url) is None


def test_parent_gone_or_sigterm_stops_the_child_and_releases_the_lock(tmp_path: Path) -> None:
    url, sched = _started(tmp_path)
    assert sched.proc is not None and sched.proc.stdin is not None
    sched.proc.stdin.close()  # what the child sees when the API process dies
    assert sched.proc.wait(30) == 0
    assert _holder(url) is None

    sched = SchedulerProcess(Settings(database_url=url, broker_url="redis://127.0.0.1:1/0")).start()
    assert sched.proc is not None
    pid = sched.proc.pid
    _until("the new child holds the lock", lambda: f":{pid}:" in (_holder(url) or ""))
    sched.proc.send_signal(signal.SIGTERM)  # a process-group kill of the API reaches it too
    assert sched.proc.wait(30) == 0
    assert _holder(url) is None
    sched.stop()  # after the child is gone: nothing to do, no error
