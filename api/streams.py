"""Open Server-Sent Event streams: a cap per client, the response that gives its slot back, and the
guard that ends a stream whose credentials are gone.

A stream holds no database connection while it waits (each read is a short session in the thread
pool), so what an open stream costs is one socket and a place on its channel's Redis subscription
(one per channel per process, api/live.py); the cap keeps one client (a runaway script, a page
reloaded in a loop) from holding hundreds of them.

A stream outlives the request that checked its token, so it asks again every
`stream_auth_check_s`: once the token or session is revoked, expired or idle, the client gets a
final `error` frame (status 401 and the reason) and the stream closes. The answer is shared by the
streams of one credential for a second, so a hundred open tabs cost one read, not a hundred.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable

from fastapi import HTTPException, Request, status
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import Session
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from api.auth import Credential, credential_problem_by_id
from api.deps import app_settings
from api.sse import frame
from api.stream_threads import in_stream_thread
from core.settings import Settings
from core.telemetry import OPEN_STREAMS

log = logging.getLogger(__name__)
_SHARED_S = 1.0
"""How long one credential check answers for every stream of that credential."""
_checked: dict[Credential, tuple[float, str | None]] = {}
_inflight: dict[Credential, asyncio.Future[str | None]] = {}


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

    media_type = "text/event-stream"  # what the OpenAPI schema names (routes' response_class)

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


async def _ask(settings: Settings, cred: Credential) -> str | None:
    try:
        why = await in_stream_thread(credential_problem_by_id, settings, cred)
    except SQLAlchemyError as e:
        # the database is busy or away: the stream goes on and the next round asks again (a
        # revocation needs the database too, so it cannot have happened unseen)
        log.warning("stream: credential check failed (%s); retrying", e)
        return None
    if len(_checked) > 10_000:
        _checked.clear()
    _checked[cred] = (time.monotonic(), why)
    return why


async def _problem(settings: Settings, cred: Credential) -> str | None:
    """The credential's answer, read at most once a second for all its streams together: those
    that ask while a read is under way wait for that one (40 streams of one token checking at
    once took 11 of the pool's connections)."""
    hit = _checked.get(cred)
    if hit is not None and time.monotonic() - hit[0] < _SHARED_S:
        return hit[1]
    task = _inflight.get(cred)
    if task is None or task.get_loop() is not asyncio.get_running_loop():
        task = _inflight[cred] = asyncio.ensure_future(_ask(settings, cred))
        task.add_done_callback(lambda t: _inflight.pop(cred, None) if _inflight.get(cred) is t else None)
    # shielded: a stream that closes meanwhile must not cancel the others' answer
    return await asyncio.shield(task)


_AHEAD_BYTES = 64 * 1024
"""How far a stream's body may run ahead of its client: past this many bytes waiting to be sent,
the body is not read again until they are (a slow client holds at most this, plus one chunk)."""


class _Pump:
    """A stream body read in a task of its own for the whole stream (not one task per chunk: that
    and its `asyncio.wait` were most of what each chunk cost the event loop with 500 streams
    open). The chunks that arrive while the sender is busy wait in `ready` and go out as one."""

    def __init__(self, body: AsyncIterator[str]) -> None:
        self.it = aiter(body)
        self.ready: list[str] = []
        self.size = 0
        self.ended = False
        self.error: BaseException | None = None
        self.wake: asyncio.Future[None] | None = None  # the sender's, while it waits
        self.room: asyncio.Future[None] | None = None  # the body's, while it waits for the sender
        self.task = asyncio.ensure_future(self._run())

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            async for chunk in self.it:
                self.ready.append(chunk)
                self.size += len(chunk)
                self.poke()
                if self.size >= _AHEAD_BYTES:
                    self.room = loop.create_future()
                    await self.room
        except Exception as e:  # the sender raises it, after the chunks before it
            self.error = e
        finally:
            self.ended = True
            self.poke()

    def poke(self) -> None:
        if self.wake is not None and not self.wake.done():
            self.wake.set_result(None)

    def take(self) -> str:
        text = self.ready[0] if len(self.ready) == 1 else "".join(self.ready)
        self.ready.clear()
        self.size = 0
        if self.room is not None and not self.room.done():
            self.room.set_result(None)
        return text


async def guarded(
    body: AsyncIterator[str], *, check: Callable[[], Awaitable[str | None]], every_s: float
) -> AsyncIterator[str]:
    """`body`'s frames, while `await check()` answers None at least every `every_s`; once it
    answers a reason, a final `error` frame and the end. The body runs in a task of its own, so a
    stream that is quiet (waiting on its channel) is checked on time too; frames that are ready
    together are sent as one chunk."""
    loop = asyncio.get_running_loop()
    pump = _Pump(body)
    # one timer per check period wakes a quiet stream (not a timeout per chunk); `due` is on the
    # loop's clock, the timer's, and a timer that fired early is set again for the rest
    due = loop.time() + every_s
    timer = loop.call_at(due, pump.poke)
    try:
        while True:
            if not pump.ready and not pump.ended and loop.time() < due:
                if timer.cancelled() or timer.when() <= loop.time():
                    timer = loop.call_at(due, pump.poke)  # it fired early: the rest of the period
                pump.wake = loop.create_future()
                try:
                    await pump.wake
                finally:
                    pump.wake = None
            if pump.ready:
                yield pump.take()
            elif pump.ended:
                if pump.error is not None:
                    raise pump.error
                return
            if loop.time() >= due:
                why = await check()
                if why is not None:
                    yield frame(event="error", data={"status": 401, "detail": f"{why}; the stream is closed"})
                    return
                due = loop.time() + every_s
                timer.cancel()
                timer = loop.call_at(due, pump.poke)
    finally:
        timer.cancel()
        if not pump.task.done():
            pump.task.cancel()
            with contextlib.suppress(asyncio.CancelledError, StopAsyncIteration):
                await pump.task
        aclose = getattr(pump.it, "aclose", None)
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
    cred: Credential | None = getattr(request.state, "credential", None)
    try:
        body = body_factory()
        if cred is not None:
            settings = app_settings(request)
            body = guarded(body, check=lambda: _problem(settings, cred), every_s=settings.stream_auth_check_s)
        return SseResponse(body, slots=slots, key=key)
    except BaseException:
        slots.release(key)
        raise
