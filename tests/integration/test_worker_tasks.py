"""A worker started with --concurrency N advertises N tasks (jobs at once) in its heartbeat, so
the scheduler runs N jobs on it at once (it advertised one whatever N was: Celery's worker_ready
is sent by the Consumer, which has no concurrency of its own), and gives each run its share of the
host's cores: every core while it runs alone, the cores over the runs beside it otherwise
(workers/cores.py), which the trainer keeps its torch threads to, between steps as they change.
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
        # its pool processes share a board made before they were forked: a job alone gets every
        # core, two at once half each, and the first takes its whole share back once alone again
        host = len(os.sched_getaffinity(0))
        assert host >= 2, "a share that changes needs a host of two cores or more"
        threads = min(host, int(os.environ.get("OMP_NUM_THREADS") or host))  # tests/conftest.py: 1
        long = handle.submit(
            {**TINY_SPEC, "name": "alone", "train": {**TINY_SPEC["train"], "steps": 100_000}}
        )
        log = st.root / "jobs" / str(long["id"]) / "stderr.log"

        def said(line: str, timeout: float = 120) -> str:
            deadline = time.monotonic() + timeout
            while True:
                text = log.read_text() if log.exists() else ""
                if line in text:
                    return text
                assert time.monotonic() < deadline, (line, text)
                time.sleep(0.2)

        said(f"trainer: {threads} torch thread(s), of the {host} core(s) its worker gave this run")
        # long enough for the first to read its share (every second) while both run
        beside = handle.submit(
            {**TINY_SPEC, "name": "beside", "train": {**TINY_SPEC["train"], "steps": 1200}}
        )
        said(f"trainer: its worker gives this run {host // 2} core(s) now: {min(host // 2, threads)} torch")
        assert handle.wait(beside["id"], timeout=180)["status"] == "succeeded"
        stderr = (st.root / "jobs" / str(beside["id"]) / "stderr.log").read_text()
        assert f"of the {host // 2} core(s) its worker gave this run" in stderr, stderr
        said(f"trainer: its worker gives this run {host} core(s) now: {threads} torch thread(s)")
        assert handle.client.post(f"/api/jobs/{long['id']}/cancel").status_code == 200
        assert handle.wait(long["id"], ("cancelled",), timeout=60)["status"] == "cancelled"
