"""A worker started with --concurrency N advertises N tasks (jobs at once) in its heartbeat, so
the scheduler runs N jobs on it at once (it advertised one whatever N was: Celery's worker_ready
is sent by the Consumer, which has no concurrency of its own), and gives each run its share of the
host's cores, the cores over N (workers/cores.py), which the trainer keeps its torch threads to.
A real Celery worker."""

from __future__ import annotations

import os
import time

import pytest

from api.stack import Stack
from tests.conftest import TINY_SPEC, running

pytestmark = pytest.mark.integration


def test_a_worker_advertises_its_concurrency_as_tasks(tmp_path_factory: pytest.TempPathFactory) -> None:
    st = Stack(root=tmp_path_factory.mktemp("tasks"), workers=1, concurrency=3)
    with running(st) as handle:
        deadline = time.monotonic() + 30
        while True:
            workers = handle.client.get("/api/health").json()["workers"]
            if workers and workers[0]["host"].get("tasks") is not None:
                break
            assert time.monotonic() < deadline, workers
            time.sleep(0.5)
        assert workers[0]["host"]["tasks"] == 3
        # its pool processes learned N before they were forked: a run gets the cores over N
        job = handle.submit({**TINY_SPEC, "name": "share"})
        assert handle.wait(job["id"], timeout=180)["status"] == "succeeded"
        stderr = (st.root / "jobs" / str(job["id"]) / "stderr.log").read_text()
        share = max(1, len(os.sched_getaffinity(0)) // 3)
        threads = min(share, int(os.environ.get("OMP_NUM_THREADS") or share))  # tests/conftest.py: 1
        assert (
            f"trainer: {threads} torch thread(s), of the {share} core(s) its worker gave this run" in stderr
        ), stderr
