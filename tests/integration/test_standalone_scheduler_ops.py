"""`shardyard scheduler` on its own (no API beside it): it serves its own instruments with
--metrics-port and delivers webhooks from the outbox. A real process over a real SQLite file."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from api.stack import free_port
from core.webhooks import verify
from db import jobs as dbj
from db import users as dbu
from db import webhooks as dbw
from db.connection import session_for
from db.migrate import upgrade
from tests.webhook_receiver import Receiver

pytestmark = pytest.mark.integration


def _tick_count(port: int) -> float:
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == "shardyard_scheduler_tick_seconds_count":
                return s.value
    return -1.0


def test_standalone_scheduler_serves_metrics_and_delivers_webhooks(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 's.db'}"
    upgrade(url)
    rx = Receiver()
    with session_for(url) as s:
        ann = dbu.create_user(s, name="ann").id
        dbw.create_webhook(s, user_id=ann, url=rx.url, events="failures", secret="k")
        job = dbj.create_job(s, name="j", spec={}, steps=1, owner_id=ann).id
        dbj.fail_job(s, job_id=job, reason="told by the standalone scheduler")
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "PROMETHEUS_MULTIPROC_DIR"}
    env.update(
        SHARDYARD_DATABASE_URL=url,
        SHARDYARD_DATA_DIR=str(tmp_path),
        # nothing is placed (no workers), so no task is ever sent to this unused port
        SHARDYARD_BROKER_URL=f"redis://127.0.0.1:{free_port()}/0",
        SHARDYARD_WEBHOOK_ALLOW='["127.0.0.1/32"]',  # the receiver is on loopback
        SHARDYARD_WEBHOOK_POLL_S="0.2",
        SHARDYARD_SCHEDULER_S="0.2",
    )
    proc = subprocess.Popen(
        [sys.executable, "-m", "api.cli", "scheduler", "--metrics-port", str(port)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 120
        ticks = -1.0
        while time.monotonic() < deadline and (ticks <= 0 or not rx.answered_ok()):
            assert proc.poll() is None, f"the scheduler exited with {proc.returncode}"
            try:
                ticks = _tick_count(port)
            except httpx.HTTPError:
                pass  # not listening yet
            time.sleep(0.2)
        assert ticks > 0, "the standalone scheduler's ticks are not on its metrics port"
        [got] = rx.answered_ok()
        assert verify("k", header=got.headers["Shardyard-Signature"], body=got.body)
        assert json.loads(got.body)["job"]["error"] == "told by the standalone scheduler"
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        rx.close()
