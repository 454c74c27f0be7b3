"""The CLI against the live API, and an idle stream's keep-alives and database catch-up."""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from db.connection import session_for
from db.jobs import create_job
from db.users import create_user
from tests.conftest import TINY_SPEC, StackHandle

pytestmark = pytest.mark.integration


def cli(stack: StackHandle, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "SHARDYARD_API_URL": stack.base_url, "COLUMNS": "200"}
    return subprocess.run(
        [sys.executable, "-m", "api.cli", *args], capture_output=True, text=True, env=env, timeout=180
    )


def test_cli_submit_follow_jobs_show_logs(stack: StackHandle, tmp_path: Path) -> None:
    spec = tmp_path / "job.json"
    spec.write_text(
        json.dumps({**TINY_SPEC, "name": "from-cli", "train": {**TINY_SPEC["train"], "steps": 10}})
    )
    out = cli(stack, "submit", str(spec), "--follow")
    assert out.returncode == 0, out.stderr
    assert "submitted job" in out.stdout and '"final_loss"' in out.stdout
    job_id = int(out.stdout.split("submitted job", 1)[1].split()[0])
    assert stack.job(job_id)["status"] == "succeeded"
    listing = cli(stack, "jobs", "--status", "succeeded")
    assert "from-cli" in listing.stdout
    shown = cli(stack, "show", str(job_id))
    assert json.loads(shown.stdout)["id"] == job_id
    logs = cli(stack, "logs", str(job_id))
    assert "parameters" in logs.stdout and "succeeded" in logs.stdout


def test_cli_errors_name_the_field_and_exit_2(stack: StackHandle, tmp_path: Path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({**TINY_SPEC, "train": {**TINY_SPEC["train"], "lr": 0}}))
    out = cli(stack, "submit", str(bad))
    assert out.returncode == 2
    assert "422" in out.stderr and "train.lr" in out.stderr
    out = cli(stack, "submit", str(tmp_path / "missing.json"))
    assert out.returncode == 2 and "cannot read" in out.stderr
    notjson = tmp_path / "x.json"
    notjson.write_text("{nope")
    out = cli(stack, "submit", str(notjson))
    assert out.returncode == 2 and "not valid JSON" in out.stderr
    out = cli(stack, "cancel", "999999")
    assert out.returncode == 2 and "404" in out.stderr
    env = {**os.environ, "SHARDYARD_API_URL": "http://127.0.0.1:9"}
    out = subprocess.run([sys.executable, "-m", "api.cli", "jobs"], capture_output=True, text=True, env=env)
    assert out.returncode == 2 and "cannot reach the API" in out.stderr


def test_idle_stream_sends_keepalives_and_catches_up_from_the_database(stack: StackHandle) -> None:
    # a job whose owner may run none: the scheduler leaves it queued, so its stream has nothing
    # to say
    with session_for(stack.stack.database_url) as s:
        held = create_user(s, name=f"idle-{time.time_ns()}", max_running_jobs=0)
        job_id = create_job(s, name="idle", spec=TINY_SPEC, steps=1, owner_id=held.id).id
    comments, statuses = 0, []
    t0 = time.monotonic()
    with httpx.stream(
        "GET",
        f"{stack.base_url}/api/jobs/{job_id}/stream",
        headers=stack.headers,
        timeout=httpx.Timeout(5, read=30),
    ) as r:
        for line in r.iter_lines():
            if line.startswith(": keep-alive"):
                comments += 1
                if comments == 2:
                    # cancelling a queued job publishes nothing on the job's channel: the
                    # stream must still learn it from the database and close
                    stack.client.post(f"/api/jobs/{job_id}/cancel")
            elif line.startswith("data:") and '"status"' in line:
                statuses.append(json.loads(line[5:])["status"])
            assert time.monotonic() - t0 < 30
    assert comments >= 2
    assert statuses == ["queued", "cancelled"]


def test_cli_prints_names_with_markup_as_they_are(stack: StackHandle, tmp_path: Path) -> None:
    """A job named `[/]` made `shardyard jobs` exit 1 (rich read the name as markup)."""
    names = ["[/]", "[bold red]loud[/]", "a[/b]c"]
    ids = []
    for name in names:
        spec = tmp_path / "job.json"
        spec.write_text(json.dumps({**TINY_SPEC, "name": name, "train": {**TINY_SPEC["train"], "steps": 1}}))
        out = cli(stack, "submit", str(spec))
        assert out.returncode == 0, out.stderr
        assert f"({name})" in out.stdout, out.stdout
        ids.append(int(out.stdout.split("submitted job", 1)[1].split()[0]))
    listing = cli(stack, "jobs", "--limit", "500")
    assert listing.returncode == 0, listing.stderr
    rows = {line.split("│")[1].strip(): line for line in listing.stdout.splitlines() if line.count("│") > 2}
    for job_id, name in zip(ids, names, strict=True):
        assert name in rows[str(job_id)], listing.stdout
    for job_id in ids:
        stack.client.post(f"/api/jobs/{job_id}/cancel")


def test_cli_follow_stops_when_its_token_is_revoked(stack: StackHandle) -> None:
    """The stream's last frame says the token is gone: the CLI stops with the reason (exit 2)
    instead of reconnecting for ever."""
    made = stack.client.post("/api/users", json={"name": f"f{time.time_ns()}"}).json()
    token = made["token"]
    endless = {**TINY_SPEC, "name": "followed", "train": {**TINY_SPEC["train"], "steps": 100000}}
    job = httpx.post(
        f"{stack.base_url}/api/jobs", json=endless, headers={"Authorization": f"Bearer {token}"}
    ).json()
    env = {**os.environ, "SHARDYARD_API_URL": stack.base_url, "SHARDYARD_TOKEN": token, "COLUMNS": "200"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "api.cli", "follow", str(job["id"])],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None and proc.stderr is not None
    printed: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [printed.put(line) for line in proc.stdout], daemon=True).start()
    try:
        # the CLI prints the job's log lines as its stream brings them: once it has printed one, its
        # stream is open. (A fixed 1 s wait stood here; a CLI slower to start, on a loaded machine,
        # then met the revoked token at its first request, which is refused outright: another path)
        printed.get(timeout=120)
        first = next(
            t for t in stack.client.get("/api/tokens").json()["items"] if t["user_id"] == made["user"]["id"]
        )
        assert stack.client.delete(f"/api/tokens/{first['id']}").status_code == 200
        proc.wait(timeout=60)
        stderr = proc.stderr.read()
        assert proc.returncode == 2 and "the token was revoked; the stream is closed" in stderr, stderr
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        stack.client.post(f"/api/jobs/{job['id']}/cancel")
