"""Losing a worker loses no job: a worker killed mid-job leaves it `running`; another worker's
reconciler notices the silent heartbeat, puts the job back in the queue, and it resumes from its
latest checkpoint to `succeeded`."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from api.stack import Stack
from tests.conftest import TINY_SPEC, StackHandle

pytestmark = pytest.mark.integration


def test_killed_worker_job_is_requeued_and_resumed(tmp_path: Path) -> None:
    fast = {"SHARDYARD_HEARTBEAT_S": "0.5", "SHARDYARD_WORKER_ALIVE_S": "2", "SHARDYARD_RECONCILE_S": "1"}
    with Stack(root=tmp_path, workers=1, extra_env=fast) as st:
        handle = StackHandle(st)
        spec = {
            **TINY_SPEC,
            "name": "survivor",
            "checkpoint_every": 5,
            "train": {**TINY_SPEC["train"], "steps": 150, "eval_every": 50},
        }
        job = handle.submit(spec)
        handle.wait_until(job["id"], lambda j: j["progress"]["step"] >= 12, timeout=120)
        # kill -9 the whole worker (its process group): no shutdown, no ack, no final status
        worker = st.procs.pop("worker1")
        os.killpg(worker.pid, signal.SIGKILL)
        worker.wait()
        assert handle.job(job["id"])["status"] == "running"
        st.start_worker(2)
        done = handle.wait(job["id"], timeout=240)
        assert done["attempts"] == 2 and done["worker"].startswith("worker2@")
        logs = [e["message"] for e in handle.client.get(f"/api/jobs/{job['id']}/logs").json()["items"]]
        assert any(m.startswith("resumed from step-") for m in logs), logs
        loss = handle.client.get(f"/api/jobs/{job['id']}/metrics", params={"names": "loss"}).json()
        assert loss["series"]["loss"]["steps"][-1] == 150
        handle.client.close()
