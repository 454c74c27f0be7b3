"""What the incident was, end to end over HTTP on the embedded stack: someone who has the broker's
password (a job's code that read it) publishes log lines, a loss point and a terminal `succeeded`
on another user's job channel. The job's open stream shows none of it and stays open while the API
says `queued`; the same messages signed with the stack's key do arrive."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import httpx
import redis

from api.stack import Stack
from core.broker import job_channel, sign_live
from tests.conftest import TINY_SPEC
from tests.sse import sse_frames


def test_a_forged_message_on_the_stacks_broker_never_reaches_an_open_stream(tmp_path: Path) -> None:
    with Stack(root=tmp_path, workers=0) as st:
        auth = {"Authorization": f"Bearer {st.admin_token}"}
        client = httpx.Client(base_url=st.base_url, headers=auth, timeout=30)
        job = client.post("/api/jobs", json={**TINY_SPEC, "name": "theirs"}).json()
        assert job["status"] == "queued"
        frames: list[tuple[str | None, str, dict]] = []
        ended = threading.Event()

        def follow() -> None:
            timeout = httpx.Timeout(10, read=60)
            with httpx.stream(
                "GET", f"{st.base_url}/api/jobs/{job['id']}/stream", headers=auth, timeout=timeout
            ) as r:
                for f in sse_frames(r.iter_lines()):
                    frames.append(f)
            ended.set()

        threading.Thread(target=follow, daemon=True).start()
        deadline = time.monotonic() + 20
        while not any(f[1] == "status" for f in frames):
            assert time.monotonic() < deadline, "the stream sent no status"
            time.sleep(0.1)

        channel = job_channel(job["id"])
        forged = [
            {
                "type": "event",
                "id": 10**6,
                "kind": "log",
                "message": "forged line",
                "data": None,
                "time": 1.0,
            },
            {
                "type": "metrics",
                "points": [{"id": 10**6, "step": 1, "name": "loss", "value": 0.1, "time": 1.0}],
            },
            {
                "type": "event",
                "id": 10**6 + 1,
                "kind": "status",
                "message": "succeeded",
                "data": None,
                "time": 1.0,
            },
        ]
        with redis.Redis.from_url(st.broker_url) as r:  # the password, as a leak would give it
            for m in forged:
                r.publish(channel, json.dumps(m))
        time.sleep(3)
        assert [f[1] for f in frames] == ["status"], f"a forged message reached the stream: {frames}"
        assert not ended.is_set(), "a forged terminal status closed the stream"
        assert client.get(f"/api/jobs/{job['id']}").json()["status"] == "queued"

        # the same live output signed with the stack's key is shown (it is the workers' key)
        line = {"type": "live_log", "message": "signed output", "time": 2.0, "rank": 0, "stream": "stdout"}
        with redis.Redis.from_url(st.broker_url) as r:
            body = json.dumps(line).encode()
            r.publish(channel, sign_live(st.broker_signing_key.encode(), channel=channel, body=body))
        deadline = time.monotonic() + 10
        while not any(f[2].get("message") == "signed output" for f in frames):
            assert time.monotonic() < deadline, f"the signed message did not arrive: {frames}"
            time.sleep(0.1)
        assert not ended.is_set()
        client.close()
