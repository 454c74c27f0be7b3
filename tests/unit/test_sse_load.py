"""What many open streams may cost the rest of the API process: their database reads run in
threads of their own (api/stream_threads.py), so a request handler never waits behind them, and a
stream that follows its channel live does not read again from the database the points on their way
to it (api/sse.py's recheck), while a publish that was lost is still sent."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import AsyncGenerator
from pathlib import Path
from types import SimpleNamespace

import pytest
from starlette.concurrency import run_in_threadpool

import api.sse
from api.sse import job_events
from api.stack import Stack
from api.stream_threads import STREAM_THREADS
from db.connection import session_for
from db.ingest import add_event
from db.models import MetricPoint
from tests.unit.test_sse_catch_up import _one_job, _publish

STREAMS = 45
"""More streams than anyio's default thread limiter has tokens (40): on one limiter they took them all."""


def test_streams_stuck_in_database_reads_do_not_hold_up_a_request(
    broker: Stack, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _, settings, job_id = _one_job(broker, tmp_path)
    release = threading.Event()
    reading = 0
    lock = threading.Lock()
    real_replay = api.sse._replay

    def stuck_replay(*args: object, **kwargs: object) -> object:
        # a read that does not come back (a database that hangs) until the test lets it
        nonlocal reading
        with lock:
            reading += 1
        release.wait(timeout=60)
        return real_replay(*args, **kwargs)

    monkeypatch.setattr(api.sse, "_replay", stuck_replay)

    async def main() -> tuple[bool, int]:
        streams = [job_events(settings, job_id=job_id, last_event_id=None) for _ in range(STREAMS)]
        for s in streams:
            assert (await anext(s)).startswith("retry:")
        replays = [asyncio.ensure_future(anext(s)) for s in streams]
        await asyncio.sleep(0.5)  # every stream is in its replay, or waits for a thread to do it
        # what a sync route does (FastAPI runs it in starlette's thread pool)
        answered = asyncio.ensure_future(run_in_threadpool(lambda: not release.is_set()))
        done, _ = await asyncio.wait({answered}, timeout=20)
        stuck = reading
        release.set()
        ok = answered in done and answered.result()
        if not done:
            await answered
        await asyncio.gather(*replays)
        for s in streams:
            await s.aclose()
        return ok, stuck

    answered_while_stuck, stuck_at_once = asyncio.run(main())
    assert answered_while_stuck, "the request waited for the streams' reads"
    assert stuck_at_once <= STREAM_THREADS  # the streams queued among themselves


def _points(url: str, job_id: int, steps: range) -> list[dict]:
    with session_for(url) as s:
        rows = [
            MetricPoint(job_id=job_id, step=i, name="loss", value=1.0 / i, time=time.time()) for i in steps
        ]
        s.add_all(rows)
        s.commit()
        return [{"id": p.id, "step": p.step, "name": p.name, "value": p.value, "time": p.time} for p in rows]


def _steps(chunk: str) -> list[int]:
    return [json.loads(line[6:])["step"] for line in chunk.splitlines() if line.startswith('data: {"step"')]


async def _read_steps(stream: AsyncGenerator[str, None], n: int) -> list[int]:
    """The steps of the points `stream` sends, until it has sent `n` of them or 20 s have passed;
    then the stream is closed."""
    got: list[int] = []
    deadline = time.monotonic() + 20
    while len(got) < n and time.monotonic() < deadline:
        got += _steps(await anext(stream))
    await stream.aclose()
    return got


def test_a_recheck_reads_only_points_whose_publish_is_overdue(
    broker: Stack, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    url, settings, job_id = _one_job(broker, tmp_path)
    settings = settings.model_copy(update={"sse_keepalive_s": 1.0})  # a recheck every second
    # the stream's first recheck comes at once (its phase is otherwise random)
    monkeypatch.setattr(api.sse, "random", SimpleNamespace(uniform=lambda lo, hi: hi))
    read_rows: list[int] = []
    real_replay = api.sse._replay

    def counted(*args: object, **kwargs: object) -> api.sse._Read:
        read = real_replay(*args, **kwargs)
        read_rows.append(sum('"step"' in f for f in read.frames))
        return read

    monkeypatch.setattr(api.sse, "_replay", counted)

    async def main() -> list[int]:
        stream = job_events(settings, job_id=job_id, last_event_id=None)
        assert (await anext(stream)).startswith("retry:")
        assert "queued" in await anext(stream)  # the replay
        # while the client reads nothing: points committed and published (they wait in the
        # stream's queue when its recheck comes), then points committed and never published
        points = await asyncio.to_thread(_points, url, job_id, range(1, 6))
        _publish(broker, job_id, {"type": "metrics", "points": points})
        await asyncio.sleep(0.5)
        await asyncio.to_thread(_points, url, job_id, range(6, 9))
        return await _read_steps(stream, 8)

    got = asyncio.run(main())
    assert got == list(range(1, 9))  # each point once, in order
    # steps 1-5 went live; the reads of the database framed only the lost ones (6-8)
    assert sum(read_rows) == 3, read_rows


def test_a_stream_that_fell_behind_reads_everything_it_missed(
    broker: Stack, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The bound is for rechecks only: with the broker gone (no live messages at all) the stream
    polls the database for everything, up to the newest point."""
    url, settings, job_id = _one_job(broker, tmp_path)
    settings = settings.model_copy(update={"broker_url": "redis://127.0.0.1:1/0", "sse_keepalive_s": 0.3})

    async def main() -> list[int]:
        stream = job_events(settings, job_id=job_id, last_event_id=None)
        assert (await anext(stream)).startswith("retry:")
        assert "queued" in await anext(stream)
        await asyncio.to_thread(_points, url, job_id, range(1, 4))
        return await _read_steps(stream, 3)

    assert asyncio.run(main()) == [1, 2, 3]


def test_streams_at_the_same_cursor_share_one_string_per_message(broker: Stack, tmp_path: Path) -> None:
    """A message's frames are encoded and joined once for all the streams that follow live, not
    once per stream (50 streams of a fast job joined 20 MB/s of frames each their own)."""
    url, settings, job_id = _one_job(broker, tmp_path)

    async def main() -> tuple[str, str]:
        streams = [job_events(settings, job_id=job_id, last_event_id=None) for _ in range(2)]
        for s in streams:
            assert (await anext(s)).startswith("retry:")
            assert "queued" in await anext(s)
        points = await asyncio.to_thread(_points, url, job_id, range(1, 50))
        _publish(broker, job_id, {"type": "metrics", "points": points})
        chunks = []
        for s in streams:
            chunk = await anext(s)
            while '"step"' not in chunk:
                chunk = await anext(s)
            chunks.append(chunk)
            await s.aclose()
        return chunks[0], chunks[1]

    a, b = asyncio.run(main())
    assert _steps(a) == list(range(1, 50))
    assert a is b


def test_a_jobs_streams_share_one_look_at_it_per_half_interval(
    broker: Stack, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Twenty streams of one job, each rechecking every second on a phase of its own: the look at
    the job (its status and newest ids) is read once for all of them per half second, and no
    stream reads rows of its own while the look shows nothing it lacks. Before, each stream's
    recheck was four queries of its own: 20 streams over 3 s made about 60. While a stream has
    sent an event in the last `_SETTLE_S`, its recheck reads for itself (a lower id of another
    writer may still commit), as every recheck did."""
    url, settings, job_id = _one_job(broker, tmp_path)
    settings = settings.model_copy(update={"sse_keepalive_s": 1.0})
    looks: list[float] = []
    replays: list[str] = []
    real_look, real_replay = api.sse._read_look, api.sse._replay

    def counted_look(*args: object, **kwargs: object) -> api.sse._Look:
        looks.append(time.monotonic())
        return real_look(*args, **kwargs)

    def counted_replay(*args: object, **kwargs: object) -> api.sse._Read:
        replays.append("read")
        return real_replay(*args, **kwargs)

    monkeypatch.setattr(api.sse, "_read_look", counted_look)
    monkeypatch.setattr(api.sse, "_replay", counted_replay)
    settle_s = 1.0
    monkeypatch.setattr(api.sse, "_SETTLE_S", settle_s)  # 5 s in the service: a shorter wait here
    n, seconds = 20, 3.0

    async def main() -> None:
        streams = [job_events(settings, job_id=job_id, last_event_id=None) for _ in range(n)]
        for s in streams:
            assert (await anext(s)).startswith("retry:")
            assert "queued" in await anext(s)

        async def drain(s: AsyncGenerator[str, None]) -> None:
            async for _ in s:
                pass

        tasks = [asyncio.ensure_future(drain(s)) for s in streams]
        # the job's status event, sent by each opening replay, settles below the streams' horizons
        # (until then a recheck reads for itself: a lower event of another writer may still come)
        await asyncio.sleep(settle_s + 0.5)
        replays.clear()
        looks.clear()
        await asyncio.sleep(seconds)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    asyncio.run(main())
    assert replays == [], replays  # no stream's own read once the look shows nothing new
    # every stream rechecked two or three times; the looks came at most one per half second
    assert 2 <= len(looks) <= seconds / 0.5 + 2, looks
    assert all(b - a >= 0.45 for a, b in zip(looks, looks[1:], strict=False)), looks


def test_a_lost_event_is_sent_by_the_next_recheck(
    broker: Stack, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An event committed and never published (its writer died between the two) is above the
    stream's horizon in the shared look, so the stream reads it: the look spares the reads, never
    the rows."""
    url, settings, job_id = _one_job(broker, tmp_path)
    settings = settings.model_copy(update={"sse_keepalive_s": 1.0})
    # the opening replay's status event settles below the horizon at once: the stream's rechecks
    # then rest on the shared look alone (within _SETTLE_S of an event sent they read anyway)
    monkeypatch.setattr(api.sse, "_SETTLE_S", 0.1)

    def lost(message: str) -> None:
        with session_for(url) as s:
            add_event(s, job_id=job_id, kind="log", message=message)
            s.commit()

    async def main() -> bool:
        stream = job_events(settings, job_id=job_id, last_event_id=None)
        assert (await anext(stream)).startswith("retry:")
        assert "queued" in await anext(stream)
        await asyncio.sleep(0.3)
        await asyncio.to_thread(lost, "never published")
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if "never published" in await anext(stream):
                await stream.aclose()
                return True
        await stream.aclose()
        return False

    assert asyncio.run(main())
