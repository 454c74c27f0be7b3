"""Failures that name their cause and the retries they earn, on the real stack (redis-server,
the API, a Celery worker process, torchrun with gloo ranks, SQLite):

- rank 1 of a 2-rank job killed with SIGKILL (what the kernel's OOM killer sends): the attempt is
  retried from its checkpoint and the job succeeds with every loss step once; its events name the
  rank, its pid and the signal, not the surviving rank's "Connection closed by peer".
- a 2-rank job whose user code raises, and one whose loss turns NaN: failed at once, not retried.
- a lost worker with max_restarts 0: the job fails naming the lost lease, not re-queued.
"""

from __future__ import annotations

import os
import re
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from api.stack import Stack
from tests.archives import targz, upload
from tests.conftest import LOST_WORKER_WINDOWS, TINY_SPEC, StackHandle, long_job, running

pytestmark = pytest.mark.integration

FAST = LOST_WORKER_WINDOWS
STEPS = 120
TWO_RANKS = {**long_job("sigkill", STEPS, checkpoint_every=10), "parallel": {"data_parallel": 2}}

BROKEN_DATA = b"""
def batches(**kwargs):
    return helper_that_does_not_exist(kwargs)
"""


@pytest.fixture(scope="module")
def h(tmp_path_factory: pytest.TempPathFactory) -> Iterator[StackHandle]:
    st = Stack(root=tmp_path_factory.mktemp("retries"), workers=1, concurrency=1, extra_env=FAST)
    with running(st) as handle:
        yield handle


def _rank_pid(root: Path, job_id: int, rank: int) -> int | None:
    """The pid of `rank` of the job's trainer: torchrun's worker processes carry RANK in their
    environment and the job's spec path on their command line."""
    spec = str(root / "jobs" / str(job_id) / "spec.json").encode()
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            cmd = Path(f"/proc/{d}/cmdline").read_bytes()
            env = Path(f"/proc/{d}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if spec in cmd and b"torch.distributed.run" not in cmd and f"RANK={rank}".encode() in env:
            return int(d)
    return None


def _events(h: StackHandle, job_id: int) -> list[dict]:
    """The job's log lines and status events, as GET /api/jobs/{id}/logs gives them."""
    return h.client.get(f"/api/jobs/{job_id}/logs").json()["items"]


def test_a_rank_killed_by_sigkill_is_named_and_the_job_is_retried(h: StackHandle) -> None:
    job = h.submit(TWO_RANKS)
    h.wait_until(job["id"], lambda j: j["progress"]["step"] >= 15, timeout=240)
    pid = _rank_pid(h.stack.root, job["id"], 1)
    assert pid is not None, "rank 1 of the job is not running"
    os.kill(pid, signal.SIGKILL)

    done = h.wait(job["id"], timeout=400)
    assert done["attempts"] == 2 and done["restarts"] == 1, done
    got = h.client.get(f"/api/jobs/{job['id']}/metrics", params={"names": "loss"}).json()
    assert got["series"]["loss"]["steps"] == list(range(1, STEPS + 1))

    events = _events(h, job["id"])
    retried = [e for e in events if e["kind"] == "status" and (e["data"] or {}).get("restart")]
    assert len(retried) == 1, retried
    reason = retried[0]["data"]["reason"]
    # the pid torchrun names is the rank's inside its sandbox's PID namespace (workers/sandbox.py)
    assert re.match(r"rank 1 \(pid \d+\) was killed by SIGKILL \(exit code -9\)", reason), reason
    assert "Connection" not in reason
    assert any(e["message"].startswith("resumed from step-") for e in events)


def test_user_code_and_nan_failures_are_not_retried(h: StackHandle) -> None:
    ws = upload(h, targz({"mydata/__init__.py": b"", "mydata/source.py": BROKEN_DATA}), name="broken")
    assert ws.status_code < 300, ws.text
    broken = h.submit(
        {
            **TINY_SPEC,
            "name": "user-code",
            "data": {"kind": "python", "entry": "mydata.source:batches", "vocab_size": 13},
            "workspace": ws.json()["ref"],
            "parallel": {"data_parallel": 2},
        }
    )
    nan = h.submit(
        {
            **TINY_SPEC,
            "name": "diverge",
            "train": {**TINY_SPEC["train"], "lr": 10.0, "optimizer": "sgd"},
            "parallel": {"data_parallel": 2},
        }
    )
    failed = h.wait(broken["id"], ("failed",), timeout=240)
    assert "user code failed" in failed["error"] and "helper_that_does_not_exist" in failed["error"], failed
    diverged = h.wait(nan["id"], ("failed",), timeout=240)
    assert "loss is nan" in diverged["error"] or "loss is inf" in diverged["error"], diverged
    for job in (failed, diverged):
        assert (job["attempts"], job["restarts"]) == (1, 0), job
        assert "killed by" not in job["error"]


def test_a_lost_worker_past_max_restarts_fails_the_job_with_the_reason(h: StackHandle) -> None:
    job = h.submit({**long_job("lost", 100_000), "max_restarts": 0})
    h.wait_until(job["id"], lambda j: j["progress"]["step"] >= 3, timeout=240)
    proc = h.stack.procs.pop("worker1")
    os.killpg(proc.pid, signal.SIGKILL)  # the worker and its trainer: the lease runs out
    proc.wait()
    time.sleep(float(FAST["SHARDYARD_LEASE_S"]))
    h.stack.start_worker(1)  # its reconciler takes the lease back
    done = h.wait(job["id"], ("failed",), timeout=240)
    assert done["attempts"] == 1 and done["restarts"] == 0
    # the worker restarted under its name: its heartbeats go on, its attempt's process is gone
    assert "the process running it was lost (its lease ran out" in done["error"], done["error"]
    assert done["error"].endswith("(not retried: max_restarts is 0)"), done["error"]
