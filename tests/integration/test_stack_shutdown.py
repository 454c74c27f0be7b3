"""`shardyard stack` stops warm on SIGTERM (as on Ctrl-C): the running job checkpoints and goes
back to `queued` before the stack exits, no process is left behind, and the next start on the same
root resumes it from its checkpoint to `succeeded` with every step once."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from api.stack import free_port
from db.engine import session_for
from db.models import Job
from tests.conftest import long_job

pytestmark = pytest.mark.integration

# long enough that the job is still running when the SIGTERM lands, on an idle machine too
STEPS = 300
SPEC = long_job("warm", STEPS)


def _start(root: Path, port: int, log: Path) -> tuple[subprocess.Popen[bytes], dict[str, str]]:
    """The stack, and the headers that sign in with the admin token it printed."""
    log.unlink(missing_ok=True)
    with log.open("ab") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "api.cli", "stack", "--root", str(root), "--port", str(port)],
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, "COLUMNS": "200"},
            start_new_session=True,
        )
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        assert proc.poll() is None, log.read_text()[-3000:]
        lines = log.read_text().splitlines()
        token = next((ln.strip() for ln in lines if ln.strip().startswith("sy_")), None)
        try:
            headers = {"Authorization": f"Bearer {token}"}
            if (
                token
                and httpx.get(f"http://127.0.0.1:{port}/api/health", timeout=2, headers=headers).json()[
                    "workers"
                ]
            ):
                return proc, headers
        except (httpx.HTTPError, ValueError, KeyError):
            pass
        time.sleep(0.5)
    raise AssertionError(f"the stack did not come up: {log.read_text()[-3000:]}")


def _left_behind(root: Path) -> list[str]:
    """Processes of this stack still alive: redis-server, uvicorn, Celery and trainers all run
    with the root as their folder or name it on their command line (read from /proc)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            cwd = os.readlink(f"/proc/{pid}/cwd")
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue  # gone meanwhile, or not ours to read
        if state != "Z" and (cwd == str(root) or str(root) in cmd):
            found.append(f"{pid}: {cmd[:200]}")
    return found


def _sigterm_and_wait(proc: subprocess.Popen[bytes], root: Path) -> int:
    proc.send_signal(signal.SIGTERM)
    rc = proc.wait(timeout=300)
    deadline = time.monotonic() + 10  # children reaped by now; give the kernel a moment
    while _left_behind(root) and time.monotonic() < deadline:
        time.sleep(0.2)
    return rc


def test_sigterm_stops_the_stack_warm_and_the_job_resumes(tmp_path: Path) -> None:
    root = tmp_path / "root"
    port = free_port()
    log = tmp_path / "stack.log"
    proc, auth = _start(root, port, log)
    api = httpx.Client(base_url=f"http://127.0.0.1:{port}", headers=auth, timeout=30)
    try:
        job_id = api.post("/api/jobs", json=SPEC).json()["id"]
        deadline = time.monotonic() + 180
        while api.get(f"/api/jobs/{job_id}").json()["progress"]["step"] < 25:
            assert time.monotonic() < deadline, "the job did not reach step 25"
            time.sleep(0.2)
        rc = _sigterm_and_wait(proc, root)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert rc == 143, log.read_text()[-3000:]
    assert _left_behind(root) == []
    with session_for(f"sqlite:///{root / 'shardyard.db'}") as s:
        job = s.get(Job, job_id)
        assert job is not None
        # given back mid-run, with a checkpoint of the step it stopped at
        assert job.status == "queued", (job.status, job.error, log.read_text()[-3000:])
        stopped_at = job.step
    assert 25 <= stopped_at < STEPS
    saved = sorted((root / "jobs" / str(job_id) / "checkpoints").glob("step-*.pt"))
    assert saved and saved[-1].name == f"step-{stopped_at:08d}.pt"

    proc, auth = _start(root, port, log)
    api = httpx.Client(base_url=f"http://127.0.0.1:{port}", headers=auth, timeout=30)
    try:
        deadline = time.monotonic() + 300
        while (job := api.get(f"/api/jobs/{job_id}").json())["status"] != "succeeded":
            assert job["status"] in ("queued", "running"), job
            assert time.monotonic() < deadline, f"the job did not finish after the restart: {job}"
            time.sleep(0.5)
        loss = api.get(f"/api/jobs/{job_id}/metrics", params={"names": "loss"}).json()
        logs = [e["message"] for e in api.get(f"/api/jobs/{job_id}/logs").json()["items"]]
        rc = _sigterm_and_wait(proc, root)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert loss["series"]["loss"]["steps"] == list(range(1, STEPS + 1))
    assert any(f"resumed from step-{stopped_at:08d}.pt at step {stopped_at}" in m for m in logs), logs
    assert job["attempts"] == 2 and job["result"]["steps"] == STEPS
    assert rc == 143 and _left_behind(root) == []
