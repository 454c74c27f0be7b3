"""The thread limiter open streams do their database work under (catch-up reads, periodic
rechecks, credential checks), apart from the request handlers'.

Starlette runs sync handlers and `run_in_threadpool` calls in one shared pool behind one limiter
(anyio's default: 40 tokens). Streams on the same limiter take tokens the requests need: 50 streams
that catch up at once (the broker came back, the API restarted and every client reconnected, a
fast job filled their queues) hold 40 threads, and a submit waits for a token behind them. Here
the streams queue among themselves for a few tokens of their own: a request never waits behind a
stream, and at most `STREAM_THREADS` of the process's threads contend for the interpreter lock on
the streams' behalf."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TypeVar

import anyio.to_thread
from anyio import CapacityLimiter
from anyio.lowlevel import RunVar

T = TypeVar("T")

STREAM_THREADS = 4
"""Database reads of streams at once, per API process (each a short session of its own)."""

_limiter: RunVar[CapacityLimiter] = RunVar("stream_limiter")


def stream_limiter() -> CapacityLimiter:
    """This event loop's limiter for streams' threads (a limiter belongs to one loop)."""
    try:
        return _limiter.get()
    except LookupError:
        limiter = CapacityLimiter(STREAM_THREADS)
        _limiter.set(limiter)
        return limiter


async def in_stream_thread(fn: Callable[..., T], *args: object, **kwargs: object) -> T:
    """`fn(*args, **kwargs)` in a thread under the streams' own limiter."""
    return await anyio.to_thread.run_sync(functools.partial(fn, *args, **kwargs), limiter=stream_limiter())
