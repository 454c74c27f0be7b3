"""A job stream that falls behind its channel (a slow client: api/live.py drops its backlog) or
loses it (a broker restart) catches up from the database before it relays anything newer, so the
points it missed are sent and not skipped by the cursor moving past them."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import redis

import api.live
import api.sse
from api.sse import job_events
from api.stack import Stack
from core.broker import job_channel, sign_live
from core.settings import Settings
from db.connection import session_for
from db.jobs import create_job, fail_job
from db.migrate import upgrade
from db.models import JobEvent, MetricPoint

KEY = "test-signing-key"
"""The streams show only what the service signed (api/live.py): these tests publish as it does."""


def _one_job(broker: Stack, tmp_path: Path) -> tuple[str, Settings, int]:
    """A migrated SQLite database holding one queued job, and settings pointing at `broker`."""
    url = f"sqlite:///{tmp_path / 'test.db'}"
    upgrade(url)
    settings = Settings(
        database_url=url, broker_url=broker.broker_url, data_dir=tmp_path, broker_signing_key=KEY
    )
    with session_for(url) as s:
        return url, settings, create_job(s, name="j", spec={}).id


def test_a_stream_that_dropped_its_backlog_still_sends_every_point(
    broker: Stack, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(api.live, "_BACKLOG", 3)  # a client this far behind drops what waits
    url, settings, job_id = _one_job(broker, tmp_path)

    def write_and_publish(steps: range) -> None:
        with redis.Redis.from_url(broker.broker_url) as r, session_for(url) as s:
            for step in steps:
                p = MetricPoint(job_id=job_id, step=step, name="loss", value=1.0 / step, time=time.time())
                s.add(p)
                s.commit()
                point = {"id": p.id, "step": step, "name": "loss", "value": p.value, "time": p.time}
                body = json.dumps({"type": "metrics", "points": [point]}).encode()
                r.publish(
                    job_channel(job_id), sign_live(KEY.encode(), channel=job_channel(job_id), body=body)
                )

    async def main() -> set[int]:
        stream = job_events(settings, job_id=job_id, last_event_id=None)
        assert (await anext(stream)).startswith("retry:")
        assert "queued" in await anext(stream)  # the replay
        # the client reads nothing while ten points are published: the stream's backlog overflows
        await asyncio.to_thread(write_and_publish, range(1, 11))
        await asyncio.sleep(0.5)
        steps: set[int] = set()
        deadline = time.monotonic() + 20
        while len(steps) < 10 and time.monotonic() < deadline:
            chunk = await anext(stream)
            steps |= {
                json.loads(line[6:])["step"] for line in chunk.splitlines() if line.startswith("data: ")
            }
        await stream.aclose()
        return steps

    assert asyncio.run(main()) == set(range(1, 11))


def _log(url: str, job_id: int, message: str) -> dict:
    with session_for(url) as s:
        ev = JobEvent(job_id=job_id, time=time.time(), kind="log", message=message, data=None)
        s.add(ev)
        s.commit()
        return {
            "type": "event",
            "id": ev.id,
            "kind": "log",
            "message": message,
            "data": None,
            "time": ev.time,
        }


def _publish(broker: Stack, job_id: int, *msgs: dict) -> None:
    with redis.Redis.from_url(broker.broker_url) as r:
        for m in msgs:
            body = json.dumps(m).encode()
            r.publish(job_channel(job_id), sign_live(KEY.encode(), channel=job_channel(job_id), body=body))


def _recheck_late(monkeypatch: pytest.MonkeyPatch) -> None:
    """The stream's first read of the database a whole keep-alive period away (its phase is drawn
    at random): a read before the live messages are handled would send them in id order, not in
    the order of the live channel these tests follow."""
    monkeypatch.setattr(api.sse, "random", SimpleNamespace(uniform=lambda lo, hi: lo))


def test_events_of_two_writers_published_out_of_order_are_both_sent_once(
    broker: Stack, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A job's events have several writers, each publishing after its own commit: the relay's
    event 100 can reach the channel after the API's 101. The stream sends both (the cursor used
    to move to 101 and drop 100 for good, from the live stream and from every replay), and a
    message it already sent, published again, is not sent twice."""
    _recheck_late(monkeypatch)
    url, settings, job_id = _one_job(broker, tmp_path)

    async def main() -> list[str]:
        stream = job_events(settings, job_id=job_id, last_event_id=None)
        assert (await anext(stream)).startswith("retry:")
        assert "queued" in await anext(stream)  # the replay
        relay_ev = await asyncio.to_thread(_log, url, job_id, "from the relay")  # committed first ...
        api_ev = await asyncio.to_thread(_log, url, job_id, "from the api")
        await asyncio.to_thread(
            _publish, broker, job_id, api_ev, relay_ev, api_ev
        )  # ... published last; one twice
        end = await asyncio.to_thread(_log, url, job_id, "end")
        await asyncio.to_thread(_publish, broker, job_id, end)
        got: list[str] = []
        deadline = time.monotonic() + 20
        while "end" not in got and time.monotonic() < deadline:
            chunk = await asyncio.wait_for(anext(stream), timeout=deadline - time.monotonic())
            got += [
                json.loads(line[6:])["message"] for line in chunk.splitlines() if line.startswith("data: ")
            ]
        await stream.aclose()
        return got

    assert asyncio.run(main()) == ["from the api", "from the relay", "end"]


async def _frames(stream, *, until: str, timeout: float = 20) -> list[tuple[str, str]]:  # noqa: ANN001
    """(SSE id, message or status) of each data frame, up to the one whose text has `until`."""
    out: list[tuple[str, str]] = []
    deadline = time.monotonic() + timeout
    while not any(until in text for _, text in out):
        chunk = await asyncio.wait_for(anext(stream), timeout=deadline - time.monotonic())
        fid = ""
        for line in chunk.splitlines():
            if line.startswith("id: "):
                fid = line[4:]
            elif line.startswith("data: "):
                data = json.loads(line[6:])
                out.append((fid, data.get("message") or data.get("status") or ""))
    return out


def test_a_client_reconnecting_between_two_writers_publishes_gets_the_lower_id_once(
    broker: Stack, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Event 101 (the API's) reaches the client before 100 (the relay's, committed first and
    published late), and the client reconnects in between with the id it last got. Its new stream
    sends 100, and not 101 again (the id used to say 'after 101', and 100 was never sent)."""
    _recheck_late(monkeypatch)
    url, settings, job_id = _one_job(broker, tmp_path)

    async def main() -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
        stream = job_events(settings, job_id=job_id, last_event_id=None)
        assert (await anext(stream)).startswith("retry:")
        assert "queued" in await anext(stream)
        relay_ev = await asyncio.to_thread(_log, url, job_id, "from the relay")
        api_ev = await asyncio.to_thread(_log, url, job_id, "from the api")
        _publish(broker, job_id, api_ev)
        first = await _frames(stream, until="from the api")
        await stream.aclose()  # the client drops here, before the relay publishes
        _publish(broker, job_id, relay_ev)
        again = job_events(settings, job_id=job_id, last_event_id=first[-1][0])
        assert (await anext(again)).startswith("retry:")
        end = await asyncio.to_thread(_log, url, job_id, "end")
        _publish(broker, job_id, end)
        second = await _frames(again, until="end")
        await again.aclose()
        return first, second

    first, second = asyncio.run(main())
    assert [m for _, m in first] == ["from the api"]
    assert [m for _, m in second] == ["from the relay", "end"]


def test_the_stream_of_a_finished_job_always_sends_its_final_status(broker: Stack, tmp_path: Path) -> None:
    """A client that reconnects past the job's final status (a later event, or one it already
    had) still gets it before the stream closes, so no client waits for it."""
    url, settings, job_id = _one_job(broker, tmp_path)
    with session_for(url) as s:
        fail_job(s, job_id=job_id, reason="the test ends it")
        s.commit()
    late = _log(url, job_id, "a log line after the end")

    async def main(last_id: str) -> list[tuple[str, str]]:
        stream = job_events(settings, job_id=job_id, last_event_id=last_id)
        assert (await anext(stream)).startswith("retry:")
        got = await _frames(stream, until="failed", timeout=10)
        with pytest.raises(StopAsyncIteration):
            await anext(stream)
        return got

    assert [m for _, m in asyncio.run(main(f"m0e{late['id']}"))] == ["failed"]
    # from the start: every event once, the final status among them, and nothing added
    assert [m for _, m in asyncio.run(main("m0e0"))] == ["queued", "failed", "a log line after the end"]


def test_a_final_status_read_before_the_job_row_shows_it_is_not_sent_twice(
    broker: Stack, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The replay reads the job's row, then its events, each in its own snapshot (SQLite without a
    read transaction, PostgreSQL's read committed): the job can end in between, so the first read
    sends the final status while the row still said 'running'. The stream then ends at its next
    read of the database, without the final status again (it used to resend it: the 'final status
    sent' was kept for one read, not for the stream)."""
    url, settings, job_id = _one_job(broker, tmp_path)
    settings = settings.model_copy(update={"sse_keepalive_s": 1.0})  # the next read comes soon
    with session_for(url) as s:
        fail_job(s, job_id=job_id, reason="the test ends it")
    real_job_status = api.sse.job_status
    calls: list[int] = []

    def row_read_before_the_end(s, job_id: int) -> str:  # noqa: ANN001
        calls.append(job_id)
        status = real_job_status(s, job_id)
        return "running" if len(calls) == 1 else status

    monkeypatch.setattr(api.sse, "job_status", row_read_before_the_end)

    async def main() -> list[str]:
        stream = job_events(settings, job_id=job_id, last_event_id=None)
        got: list[str] = []
        async with asyncio.timeout(20):
            async for chunk in stream:
                for line in chunk.splitlines():
                    if line.startswith("data: "):
                        data = json.loads(line[6:])
                        got.append(data.get("message") or data.get("status") or "")
        return got

    assert asyncio.run(main()) == ["queued", "failed"]
    assert len(calls) >= 2  # the stream did read the row again (and then ended)
