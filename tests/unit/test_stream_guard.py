"""The guard around an open stream (api/streams.py `guarded`): its body's frames pass in order,
those ready together as one chunk; a quiet stream is still asked about its credential on time and
closed with an `error` frame once it is gone; the body runs at most `_AHEAD_BYTES` ahead of a slow
client; and however the stream ends, its body is closed."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import pytest

from api import streams
from api.streams import guarded


async def _ok() -> str | None:
    return None


def test_frames_pass_in_order_and_those_ready_together_go_as_one() -> None:
    async def body() -> AsyncIterator[str]:
        yield "a"
        await asyncio.sleep(0.05)  # the sender has sent "a" and waits again
        for part in "bcd":
            yield part  # three ready before the sender runs again

    async def main() -> list[str]:
        return [chunk async for chunk in guarded(body(), check=_ok, every_s=60)]

    assert asyncio.run(main()) == ["a", "bcd"]


def test_a_quiet_stream_is_checked_on_time_and_closed_with_the_reason() -> None:
    closed = asyncio.Event()
    asked: list[float] = []

    async def quiet() -> AsyncIterator[str]:
        try:
            yield "retry: 2000\n\n"
            await asyncio.sleep(3600)  # its channel says nothing
            yield "never"
        finally:
            closed.set()

    async def main() -> tuple[list[str], float]:
        loop = asyncio.get_running_loop()
        start = loop.time()

        async def check() -> str | None:
            asked.append(loop.time() - start)
            return None if len(asked) < 3 else "the token was revoked"

        got = [chunk async for chunk in guarded(quiet(), check=check, every_s=0.1)]
        return got, loop.time() - start

    got, took = asyncio.run(main())
    assert got[0] == "retry: 2000\n\n" and len(got) == 2, got
    assert got[1].startswith("event: error\n")
    data = json.loads(got[1].split("data: ", 1)[1])
    assert data == {"status": 401, "detail": "the token was revoked; the stream is closed"}
    assert len(asked) == 3 and all(b - a >= 0.09 for a, b in zip([0.0, *asked], asked, strict=False)), asked
    assert took < 5, "the quiet stream waited for its body instead of its check"
    assert closed.is_set(), "the body was not closed"


def test_the_bodys_error_comes_after_the_frames_before_it() -> None:
    async def failing() -> AsyncIterator[str]:
        yield "one"
        raise RuntimeError("the database went away")

    async def main() -> list[str]:
        got: list[str] = []
        with pytest.raises(RuntimeError, match="went away"):
            async for chunk in guarded(failing(), check=_ok, every_s=60):
                got.append(chunk)
        return got

    assert asyncio.run(main()) == ["one"]


def test_the_body_waits_for_a_slow_client(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(streams, "_AHEAD_BYTES", 10)
    made = 0

    async def fast() -> AsyncIterator[str]:
        nonlocal made
        while True:
            made += 1
            yield "x" * 4

    async def main() -> tuple[int, int]:
        g = guarded(fast(), check=_ok, every_s=60)
        first = await anext(g)
        await asyncio.sleep(0.05)  # the client is slow: the body must not run on meanwhile
        ahead = made
        await g.aclose()
        return len(first), ahead

    first, ahead = asyncio.run(main())
    assert first <= 12 and ahead <= 6, (first, ahead)


def test_closing_the_stream_closes_a_body_that_is_waiting() -> None:
    closed = asyncio.Event()

    async def waiting() -> AsyncIterator[str]:
        try:
            yield "first"
            await asyncio.sleep(3600)
            yield "never"
        finally:
            closed.set()

    async def main() -> bool:
        g = guarded(waiting(), check=_ok, every_s=60)
        assert await anext(g) == "first"
        await g.aclose()  # the client went away
        return closed.is_set()

    assert asyncio.run(main())
