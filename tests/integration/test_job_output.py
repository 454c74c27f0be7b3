"""What a user sees of a running job through the real stack (HTTP -> Celery worker -> trainer):
the trainer's own output, user code included, in the job's log with its rank and stream; a failed
job's traceback there; and the CPU hardware series (the rank's CPU % and RSS) in its metrics."""

from __future__ import annotations

import os
import queue
import subprocess
import sys
import threading
import time

import httpx
import pytest
from sqlalchemy import update

from db.connection import session_for
from db.models import User
from tests.archives import targz, upload
from tests.conftest import TINY_SPEC, StackHandle
from tests.integration.test_cli_and_stream_idle import cli

pytestmark = pytest.mark.integration

# the user's data source prints, warns, and (`failing`) raises: the trainer's own output
CHATTY_PY = b"""
import sys
import threading
import time
import warnings

import torch


def batches(*, batch_size, seq_len, seed, period, pause=0.0, spin=False, fail_at=None):
    def stream(offset):
        g = torch.Generator().manual_seed(seed + offset)
        n = 0
        while True:
            n += 1
            if offset == 0 and n == 3:
                print("hello from the user's data", flush=True)
                warnings.warn("a user warning, on stderr")
            if offset == 0 and fail_at is not None and n == fail_at:
                raise RuntimeError("the user's data ran dry")
            if spin:  # the pause computing, not sleeping: the rank's CPU time grows
                end = time.monotonic() + pause
                while time.monotonic() < end:
                    pass
            else:
                time.sleep(pause)
            starts = torch.randint(0, period, (batch_size, 1), generator=g)
            w = (starts + torch.arange(seq_len + 1)) % period
            yield w[:, :-1], w[:, 1:]
    return stream(0), stream(1)
"""


def chatty_spec(ws: str, *, name: str, steps: int, **args: object) -> dict:
    return {
        "name": name,
        "workspace": ws,
        "model": {"kind": "gpt", "layers": 1, "d_model": 32, "heads": 2, "seq_len": 16},
        "data": {
            "kind": "python",
            "entry": "chatty.source:batches",
            "args": {"period": 13, **args},
            "vocab_size": 13,
        },
        "train": {"steps": steps, "batch_size": 8, "lr": 3e-3, "eval_every": steps},
    }


def upload_chatty(stack: StackHandle) -> str:
    resp = upload(stack, targz({"chatty/__init__.py": b"", "chatty/source.py": CHATTY_PY}), name="chatty")
    assert resp.status_code == 201, resp.text
    return resp.json()["ref"]


def logs(stack: StackHandle, job_id: int) -> list[dict]:
    return stack.client.get(f"/api/jobs/{job_id}/logs", params={"limit": 10_000}).json()["items"]


def test_user_output_and_cpu_hardware_series_land_with_the_job(stack: StackHandle) -> None:
    ws = upload_chatty(stack)
    # slow enough (~0.25 s a step) for the worker's samples every 5 s to catch it running; the pause
    # spins, so the rank computes through it (a sleeping pause left its CPU near 1%, too near the line)
    job = stack.submit(chatty_spec(ws, name="chatty", steps=40, pause=0.25, spin=True))
    stack.wait(job["id"], timeout=240)

    lines = logs(stack, job["id"])
    printed = [e for e in lines if e["message"] == "hello from the user's data"]
    # a print goes to the job's log through stderr: the trainer keeps its stdout for its protocol
    assert printed and printed[0]["data"] == {"rank": 0, "stream": "stderr"}
    warned = [e for e in lines if "a user warning, on stderr" in e["message"]]
    assert warned and warned[0]["data"] == {"rank": 0, "stream": "stderr"}

    series = stack.client.get(f"/api/jobs/{job['id']}/metrics").json()["series"]
    rss, cpu = series.get("hw.rss_mb.r0"), series.get("hw.cpu_pct.r0")
    assert rss and cpu, f"no hardware series among {sorted(series)}"
    # a trainer with torch loaded holds well over 50 MB, and it was computing when sampled
    assert min(rss["values"]) > 50
    assert max(cpu["values"]) > 10
    # samples are stored at the step the trainer had reached: within the run's steps
    assert all(0 <= s <= 40 for s in rss["steps"])


def test_a_failed_jobs_traceback_is_in_its_log(stack: StackHandle) -> None:
    ws = upload_chatty(stack)
    job = stack.submit(chatty_spec(ws, name="dry", steps=20, fail_at=6))
    failed = stack.wait(job["id"], ("failed",), timeout=180)
    assert "the user's data ran dry" in failed["error"]
    stderr = [e["message"] for e in logs(stack, job["id"]) if (e["data"] or {}).get("stream") == "stderr"]
    text = "\n".join(stderr)
    assert "Traceback (most recent call last):" in text
    # the traceback names the user's file and the line that raised
    line = (
        CHATTY_PY.decode()
        .splitlines()
        .index('                raise RuntimeError("the user\'s data ran dry")')
        + 1
    )
    assert (
        f'chatty/source.py", line {line}, in stream' in text
        and "RuntimeError: the user's data ran dry" in text
    )


def test_cli_logs_follow_by_rank_and_follow_shows_the_pace(stack: StackHandle) -> None:
    ws = upload_chatty(stack)
    job = stack.submit(chatty_spec(ws, name="chatty-cli", steps=30, pause=0.1))
    # started while the job is queued or running: it streams the log and returns when the job ends
    logs = cli(stack, "logs", str(job["id"]), "-f", "--rank", "0")
    assert logs.returncode == 0, logs.stderr
    assert "[rank 0] hello from the user's data" in logs.stdout
    assert "status" not in logs.stdout  # status lines name no rank: --rank leaves them out
    assert stack.job(job["id"])["status"] == "succeeded"
    everything = cli(stack, "logs", str(job["id"]))
    assert "status succeeded" in everything.stdout and "hello from the user's data" in everything.stdout

    again = stack.submit(chatty_spec(ws, name="chatty-follow", steps=30, pause=0.1))
    followed = cli(stack, "follow", str(again["id"]))
    assert followed.returncode == 0, followed.stderr
    assert "steps/s" in followed.stdout and "ETA" in followed.stdout
    assert "[rank 0] hello from the user's data" in followed.stdout
    listing = cli(stack, "jobs")
    assert "duration" in listing.stdout


def test_follow_prints_why_a_queued_job_waits(stack: StackHandle) -> None:
    """A user at their quota of one running job: `follow` of their second job says why it waits
    (before, it showed "queued" with no reason)."""
    made = stack.client.post("/api/users", json={"name": f"q{time.time_ns()}"}).json()
    with session_for(stack.stack.database_url) as s:
        s.execute(update(User).where(User.id == made["user"]["id"]).values(max_running_jobs=1))
        s.commit()
    auth = {"Authorization": f"Bearer {made['token']}"}
    jobs = []
    for name in ("first", "second"):
        endless = {**TINY_SPEC, "name": name, "train": {**TINY_SPEC["train"], "steps": 100_000}}
        resp = httpx.post(f"{stack.base_url}/api/jobs", json=endless, headers=auth)
        assert resp.status_code == 201, resp.text
        jobs.append(resp.json()["id"])
    first, second = jobs
    stack.wait_until(second, lambda j: (j["wait_reason"] or "").startswith("quota:"), timeout=120)
    env = {
        **os.environ,
        "SHARDYARD_API_URL": stack.base_url,
        "SHARDYARD_TOKEN": made["token"],
        "COLUMNS": "200",
    }
    proc = subprocess.Popen(
        [sys.executable, "-m", "api.cli", "follow", str(second)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stderr is not None
        lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=lambda: lines.put(proc.stderr.readline()), daemon=True).start()
        line = lines.get(timeout=60)  # the first thing it says (without the reason: nothing, for ever)
        assert line.startswith("queued: quota: 1 of") and "the quota is 1" in line, line
    finally:
        for job_id in (second, first):
            stack.client.post(f"/api/jobs/{job_id}/cancel")
        proc.communicate(timeout=120)
