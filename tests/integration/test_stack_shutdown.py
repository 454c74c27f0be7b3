"""`shardyard stack` stops warm on SIGTERM (as on Ctrl-C): the running job checkpoints and goes
back to `queued` before the stack exits, no process is left behind, and the next start on the same
root resumes it from its checkpoint to `succeeded` with every step once."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest

from api.stack import free_port
from db.connection import session_for
from db.models import Job
from tests.conftest import long_job
from tests.stack_cli import left_behind, sigterm_and_wait, start_stack_cli
from tests.user_data import held_data, let_go_when_asked, upload_held

pytestmark = pytest.mark.integration

STEPS = 300
SPEC = long_job("warm", STEPS)
HOLD_AT = 40
"""The job waits at its 40th batch (tests/user_data.py) until the SIGTERM has asked it to stop, so
the SIGTERM lands mid-job whatever the machine's speed (a job long enough on one machine is not on
a faster one)."""


def test_sigterm_stops_the_stack_warm_and_the_job_resumes(tmp_path: Path, gate: Path) -> None:
    root = tmp_path / "root"
    port = free_port()
    log = tmp_path / "stack.log"
    proc, auth = start_stack_cli(root, port, log)
    api = httpx.Client(base_url=f"http://127.0.0.1:{port}", headers=auth, timeout=30)
    try:
        held = {**SPEC, **held_data(upload_held(SimpleNamespace(client=api)), gate, hold_at=HOLD_AT)}
        job_id = api.post("/api/jobs", json=held).json()["id"]
        deadline = time.monotonic() + 180
        while api.get(f"/api/jobs/{job_id}").json()["progress"]["step"] < 25:
            assert time.monotonic() < deadline, "the job did not reach step 25"
            time.sleep(0.2)
        let_go_when_asked(gate, root / "jobs" / str(job_id) / "stop")
        rc = sigterm_and_wait(proc, root)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert rc == 143, log.read_text()[-3000:]
    assert left_behind(root) == []
    with session_for(f"sqlite:///{root / 'shardyard.db'}") as s:
        job = s.get(Job, job_id)
        assert job is not None
        # given back mid-run, with a checkpoint of the step it stopped at
        assert job.status == "queued", (job.status, job.error, log.read_text()[-3000:])
        stopped_at = job.step
    assert 25 <= stopped_at < STEPS
    saved = sorted((root / "jobs" / str(job_id) / "checkpoints").glob("step-*.pt"))
    assert saved and saved[-1].name == f"step-{stopped_at:08d}.pt"

    proc, auth = start_stack_cli(root, port, log)
    api = httpx.Client(base_url=f"http://127.0.0.1:{port}", headers=auth, timeout=30)
    try:
        deadline = time.monotonic() + 300
        while (job := api.get(f"/api/jobs/{job_id}").json())["status"] != "succeeded":
            assert job["status"] in ("queued", "running"), job
            assert time.monotonic() < deadline, f"the job did not finish after the restart: {job}"
            time.sleep(0.5)
        loss = api.get(f"/api/jobs/{job_id}/metrics", params={"names": "loss"}).json()
        logs = [e["message"] for e in api.get(f"/api/jobs/{job_id}/logs").json()["items"]]
        rc = sigterm_and_wait(proc, root)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert loss["series"]["loss"]["steps"] == list(range(1, STEPS + 1))
    assert any(f"resumed from step-{stopped_at:08d}.pt at step {stopped_at}" in m for m in logs), logs
    assert job["attempts"] == 2 and job["result"]["steps"] == STEPS
    assert rc == 143 and left_behind(root) == []
