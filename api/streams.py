"""Open Server-Sent Event streams: a cap per client, and the response that gives its slot back.

A stream holds no database connection while it waits (each read is a short session in the thread
pool), so what an open stream costs is one socket and a place on its channel's Redis subscription
(one per channel per process, api/live.py); the cap keeps one client (a runaway script, a page
reloaded in a loop) from holding hundreds of them.
"""

from __future__ import annotations

import threading
from collections.abc import AsyncIterator

from fastapi import HTTPException, Request, status
from sqlalchemy.orm import Session
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from core.telemetry import OPEN_STREAMS


def client_key(request: Request, user: object | None = None) -> str:
    """Whom a stream counts against: the signed-in user, else the peer address."""
    if user is not None:
        return f"user:{getattr(user, 'id', user)}"
    return f"addr:{request.client.host if request.client else 'unknown'}"


class StreamSlots:
    """Counts open streams per client (one API process)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._open: dict[str, int] = {}
        self._lock = threading.Lock()

    def acquire(self, key: str) -> bool:
        with self._lock:
            n = self._open.get(key, 0)
            if n >= self.limit:
                return False
            self._open[key] = n + 1
            OPEN_STREAMS.inc()
            return True

    def release(self, key: str) -> None:
        with self._lock:
            n = self._open.get(key, 0) - 1
            if key in self._open:
                OPEN_STREAMS.dec()
            if n > 0:
                self._open[key] = n
            else:
                self._open.pop(key, None)

    def open_streams(self) -> int:
        with self._lock:
            return sum(self._open.values())


class SseResponse(StreamingResponse):
    """A text/event-stream that releases its client's slot however it ends (finished, client gone,
    server stopping) and closes its generator at once, so it leaves its channel's Redis
    subscription (the last stream to leave unsubscribes)."""

    def __init__(self, body: AsyncIterator[str], *, slots: StreamSlots, key: str) -> None:
        super().__init__(
            body,
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
        self._body = body
        self._slots = slots
        self._key = key

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._slots.release(self._key)
            aclose = getattr(self._body, "aclose", None)
            if aclose is not None:
                await aclose()


def open_stream(
    request: Request,
    body_factory,  # noqa: ANN001 - () -> AsyncIterator[str]
    *,
    session: Session | None = None,
    user: object | None = None,
) -> SseResponse:
    """The stream `body_factory()` makes, or 429 when this client (`user`) already has its cap
    open. `session` is the request's own (the sign-in check read the user with it): it is closed
    here, before the stream starts, because a request-scoped session lives until the response
    ends, and a stream that kept its connection for hours would starve the pool."""
    if session is not None:
        session.close()
    slots: StreamSlots = request.app.state.stream_slots
    key = client_key(request, user)
    if not slots.acquire(key):
        raise HTTPException(
            status.HTTP_429_TOO_MANY_REQUESTS,
            f"too many open streams: this client already has {slots.limit} "
            "(SHARDYARD_SSE_MAX_PER_CLIENT); close one before opening another",
            headers={"Retry-After": "5"},
        )
    try:
        return SseResponse(body_factory(), slots=slots, key=key)
    except BaseException:
        slots.release(key)
        raise
