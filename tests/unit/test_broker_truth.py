"""The broker carries wake-ups, not truth: whoever can publish on Redis (a job's code that read the
broker's password, another user's process) must not put log lines, points or a job's end on
another user's open stream. What a stream shows comes from the database or from a message the
service signed (core/broker.py, api/live.py); a job's or batch's end comes from the database
alone. And the embedded stack's redis-server refuses a client without its password."""

from __future__ import annotations

import asyncio
import json
import socket
import time
from collections.abc import AsyncIterator
from pathlib import Path
from types import SimpleNamespace

import redis
from prometheus_client import REGISTRY
from sqlalchemy import update

from api.routes.events import _all_jobs
from api.selection_stream import selection_events
from api.sse import job_events
from api.stack import Stack
from core.broker import JOBS_CHANNEL, job_channel, open_live, selection_channel, sign_live
from core.settings import Settings
from db import selections as dbs
from db.connection import session_for
from db.jobs import create_job, fail_job
from db.migrate import upgrade
from db.models import Job, JobEvent, Selection, Trial
from workers.publisher import LivePublisher

KEY = "the-service-key"
OTHER_KEY = b"a-key-someone-guessed"


def _settings(broker: Stack, tmp_path: Path, *, key: str | None = KEY) -> Settings:
    url = f"sqlite:///{tmp_path / 'test.db'}"
    upgrade(url)
    return Settings(database_url=url, broker_url=broker.broker_url, data_dir=tmp_path, broker_signing_key=key)


def _job(settings: Settings) -> int:
    with session_for(settings.database_url) as s:
        return create_job(s, name="theirs", spec={}).id


def _send(broker: Stack, channel: str, *payloads: bytes) -> None:
    with redis.Redis.from_url(broker.broker_url) as r:
        for p in payloads:
            r.publish(channel, p)


def _signed(channel: str, body: dict, *, key: bytes = KEY.encode(), now: float | None = None) -> bytes:
    return sign_live(key, channel=channel, body=json.dumps(body).encode(), now=now)


def _forgeries(channel: str, bodies: list[dict]) -> list[bytes]:
    """Every way a message can fail to verify: no signature, another key, a real signature made
    for another channel, one too old (a copy published again later), a body changed after."""
    out: list[bytes] = []
    for body in bodies:
        raw = json.dumps(body).encode()
        real = _signed(channel, {**body, "altered": False})
        altered = real.replace(b'"altered": false', b'"altered": true ')
        assert altered != real
        out += [
            raw,
            _signed(channel, body, key=OTHER_KEY),
            _signed(channel + "0", body),
            _signed(channel, body, now=time.time() - 3600),
            altered,
        ]
    return out


def _rejected() -> float:
    return sum(
        REGISTRY.get_sample_value("shardyard_live_messages_rejected_total", {"why": why}) or 0.0
        for why in ("unsigned", "bad_signature", "not_json")
    )


class _Reader:
    """Reads a stream in the background, keeping its data frames, so a test can look at what it
    sent so far without closing it."""

    def __init__(self, stream: AsyncIterator[str]) -> None:
        self.stream = stream
        self.frames: list[tuple[str, dict]] = []
        self.task = asyncio.ensure_future(self._run())

    async def _run(self) -> None:
        async for chunk in self.stream:
            event = ""
            for line in chunk.splitlines():
                if line.startswith("event: "):
                    event = line[7:]
                elif line.startswith("data: "):
                    self.frames.append((event, json.loads(line[6:])))

    async def until(self, check, timeout: float = 10.0) -> None:  # noqa: ANN001
        deadline = time.monotonic() + timeout
        while not check(self.frames):
            assert not self.task.done(), f"the stream ended: {self.frames}"
            assert time.monotonic() < deadline, f"timed out; frames: {self.frames}"
            await asyncio.sleep(0.05)

    async def close(self) -> None:
        self.task.cancel()
        try:
            await self.task
        except asyncio.CancelledError:
            pass
        await self.stream.aclose()


def _texts(frames: list[tuple[str, dict]]) -> list[str]:
    return [str(d.get("message") or d.get("status") or d.get("name") or "") for _, d in frames]


_FORGED = [
    {"type": "event", "id": 10**6, "kind": "log", "message": "forged log line", "data": None, "time": 1.0},
    {
        "type": "metrics",
        "points": [{"id": 10**6, "step": 1, "name": "forged_loss", "value": 0.1, "time": 1.0}],
    },
    {"type": "live_log", "message": "forged output", "time": 1.0, "rank": 0, "stream": "stdout"},
    {"type": "event", "id": 10**6 + 1, "kind": "status", "message": "succeeded", "data": None, "time": 1.0},
]


def test_forged_messages_never_reach_a_job_stream_and_only_the_database_ends_it(
    broker: Stack, tmp_path: Path
) -> None:
    settings = _settings(broker, tmp_path)
    job_id = _job(settings)
    channel = job_channel(job_id)

    async def main() -> None:
        reader = _Reader(job_events(settings, job_id=job_id, last_event_id=None))
        await reader.until(lambda f: "queued" in _texts(f))
        before = _rejected()
        forged = _forgeries(channel, _FORGED)
        await asyncio.to_thread(_send, broker, channel, *forged)
        await asyncio.sleep(2.5)
        assert _texts(reader.frames) == ["queued"], "a forged message reached the stream"
        assert not reader.task.done(), "a forged terminal status closed the stream"
        assert _rejected() - before == len(forged)  # each one dropped and counted

        # the service's own messages go through, live: a stored event, and output past the
        # stored head that only the channel carries
        with session_for(settings.database_url) as s:
            ev = JobEvent(job_id=job_id, time=time.time(), kind="log", message="a real line", data=None)
            s.add(ev)
            s.execute(update(Job).where(Job.id == job_id).values(status="running"))
            s.commit()
            real = {
                "type": "event",
                "id": ev.id,
                "kind": "log",
                "message": ev.message,
                "data": None,
                "time": ev.time,
            }
        live_out = {"type": "live_log", "message": "live output", "time": 2.0, "rank": 0, "stream": "stdout"}
        t0 = time.monotonic()
        await asyncio.to_thread(_send, broker, channel, _signed(channel, real), _signed(channel, live_out))
        await reader.until(lambda f: "live output" in _texts(f), timeout=5)
        assert time.monotonic() - t0 < 5  # live, not the 15 s recheck
        assert _texts(reader.frames) == ["queued", "a real line", "live output"]

        # even a signed terminal status is a claim: while the database says running, the stream
        # stays open and sends no status
        claim = {
            "type": "event",
            "id": ev.id + 50,
            "kind": "status",
            "message": "succeeded",
            "data": None,
            "time": 3.0,
        }
        await asyncio.to_thread(_send, broker, channel, _signed(channel, claim))
        await asyncio.sleep(1.5)
        assert "succeeded" not in _texts(reader.frames) and not reader.task.done()

        # the job ends in the database: its status event ends the stream at once
        with session_for(settings.database_url) as s:
            fail_job(s, job_id=job_id, reason="it ended")
            s.commit()
            end = (
                s.query(JobEvent).filter_by(job_id=job_id, kind="status").order_by(JobEvent.id.desc()).first()
            )
            end_msg = {
                "type": "event",
                "id": end.id,
                "kind": "status",
                "message": end.message,
                "data": end.data,
                "time": end.time,
            }
        t0 = time.monotonic()
        await asyncio.to_thread(_send, broker, channel, _signed(channel, end_msg))
        await asyncio.wait_for(reader.task, timeout=5)
        assert time.monotonic() - t0 < 5
        assert _texts(reader.frames)[-1] == "failed"
        assert "succeeded" not in _texts(reader.frames)
        await reader.close()

    asyncio.run(main())


def test_without_a_key_every_message_is_only_a_wake_up(broker: Stack, tmp_path: Path) -> None:
    """An API with no signing key verifies nothing: a message only makes the stream read the
    database (soon: not at the 15 s recheck), and what it claims is shown nowhere."""
    settings = _settings(broker, tmp_path, key=None)
    job_id = _job(settings)
    channel = job_channel(job_id)

    async def main() -> None:
        reader = _Reader(job_events(settings, job_id=job_id, last_event_id=None))
        await reader.until(lambda f: "queued" in _texts(f))
        await asyncio.to_thread(_send, broker, channel, *[json.dumps(m).encode() for m in _FORGED])
        await asyncio.to_thread(_send, broker, channel, *[_signed(channel, m) for m in _FORGED])
        await asyncio.sleep(2.0)
        assert _texts(reader.frames) == ["queued"] and not reader.task.done()
        with session_for(settings.database_url) as s:
            s.add(
                JobEvent(job_id=job_id, time=time.time(), kind="log", message="from the database", data=None)
            )
            s.commit()
        t0 = time.monotonic()
        await asyncio.to_thread(_send, broker, channel, b"{}")
        await reader.until(lambda f: "from the database" in _texts(f), timeout=5)
        assert time.monotonic() - t0 < 5
        await reader.close()

    asyncio.run(main())


def test_forged_messages_never_reach_a_selection_stream(broker: Stack, tmp_path: Path) -> None:
    settings = _settings(broker, tmp_path)
    with session_for(settings.database_url) as s:
        sel = dbs.create_selection(s, name="b", request={}, metric="loss", mode="min", scheduler="x")
        (trial,) = dbs.add_trials(
            s, selection_id=sel.id, plans=[(0, {}, {"train": {"steps": 4}})], queue="cpu"
        )
        sid, tid = sel.id, trial.id
        s.execute(update(Selection).where(Selection.id == sid).values(status="running"))
        s.execute(update(Trial).where(Trial.id == tid).values(status="running"))
        s.commit()
    channel = selection_channel(sid)
    forged_trial = {"type": "trial", "trial": {"id": tid, "status": "succeeded", "best": -1.0}}
    claim = {"type": "selection", "status": "succeeded"}

    async def main() -> None:
        reader = _Reader(selection_events(settings, selection_id=sid))
        await reader.until(lambda f: ("status", {"status": "running"}) in f)
        shown = len(reader.frames)
        await asyncio.to_thread(_send, broker, channel, *_forgeries(channel, [forged_trial, claim]))
        # a signed batch status is a claim too: the database still says running
        await asyncio.to_thread(_send, broker, channel, _signed(channel, claim))
        await asyncio.sleep(2.0)
        assert reader.frames[shown:] == [] and not reader.task.done()
        # a signed trial state goes out as it is
        real_trial = {"type": "trial", "trial": {"id": tid, "status": "running", "steps_done": 2}}
        await asyncio.to_thread(_send, broker, channel, _signed(channel, real_trial))
        await reader.until(lambda f: ("trial", real_trial["trial"]) in f, timeout=5)
        with session_for(settings.database_url) as s:
            s.execute(update(Selection).where(Selection.id == sid).values(status="succeeded"))
            s.commit()
        await asyncio.to_thread(_send, broker, channel, _signed(channel, claim))
        await asyncio.wait_for(reader.task, timeout=5)
        assert reader.frames[-1] == ("status", {"status": "succeeded"})
        await reader.close()

    asyncio.run(main())


def test_the_jobs_table_stream_shows_no_forged_deletion(broker: Stack, tmp_path: Path) -> None:
    settings = _settings(broker, tmp_path)
    user = SimpleNamespace(id=7, is_admin=False)
    gone = {"job_id": 424242, "status": "deleted", "owner_id": 7}

    async def main() -> None:
        reader = _Reader(_all_jobs(settings, user))  # type: ignore[arg-type]
        await asyncio.sleep(0.5)  # subscribed
        await asyncio.to_thread(_send, broker, JOBS_CHANNEL, *_forgeries(JOBS_CHANNEL, [gone]))
        await asyncio.sleep(1.5)
        assert reader.frames == []
        await asyncio.to_thread(_send, broker, JOBS_CHANNEL, _signed(JOBS_CHANNEL, gone))
        await reader.until(lambda f: f == [("deleted", {"job_id": 424242})], timeout=5)
        await reader.close()

    asyncio.run(main())


def test_the_workers_publisher_signs_each_message_for_each_channel(broker: Stack) -> None:
    with redis.Redis.from_url(broker.broker_url) as r:
        sub = r.pubsub()
        sub.subscribe("a", "b")
        for _ in range(2):
            assert sub.get_message(timeout=5)["type"] == "subscribe"
        pub = LivePublisher(broker.broker_url, signing_key=KEY.encode())
        pub.send({"type": "metrics", "points": []}, channels=("a", "b"))
        assert pub.drain(timeout_s=10)
        got = {}
        while len(got) < 2:
            m = sub.get_message(timeout=5)
            assert m is not None
            if m["type"] == "message":
                got[m["channel"].decode()] = m["data"]
        sub.close()
    for ch in ("a", "b"):
        body = open_live(KEY.encode(), channel=ch, payload=got[ch])
        assert body is not None and json.loads(body) == {"type": "metrics", "points": []}
    assert open_live(KEY.encode(), channel="b", payload=got["a"]) is None


def test_the_embedded_redis_refuses_a_client_without_its_password(broker: Stack) -> None:
    with socket.create_connection(("127.0.0.1", broker.redis_port), timeout=5) as s:
        s.sendall(b"PING\r\n")
        assert s.recv(64).startswith(b"-NOAUTH")
    with redis.Redis(port=broker.redis_port) as r:
        try:
            r.publish(job_channel(1), b"{}")
        except redis.AuthenticationError:
            pass
        else:
            raise AssertionError("an unauthenticated PUBLISH went through")
    with redis.Redis.from_url(broker.broker_url) as r:  # the stack's own URL carries the password
        assert r.ping()
    assert (broker.root / "redis" / "redis.conf").stat().st_mode & 0o077 == 0
