"""Redis pub/sub for the streams of one API process, surviving the broker going away.

All the streams of an event loop share one broker connection (`_Hub`), and each channel is
subscribed once however many streams follow it: a message is read and decoded once, then handed to
every stream on its channel. With one connection per stream, 50 streams on a job meant 50 reads,
parses and wake-ups of the event loop per published message (bench/api_load.py).

When redis-server goes away (restart, network) the streams keep going on database polls and the
hub subscribes again once the broker answers. Live messages are only a fast path; the database has
everything they carried.

The broker carries wake-ups, not truth: whoever reaches Redis can publish on any channel. With a
signing key (SHARDYARD_BROKER_SIGNING_KEY) the hub verifies each message once (core/broker.py
open_live) and hands the streams only those the service's own processes signed for that channel;
the rest are dropped, counted (shardyard_live_messages_rejected) and logged. Without a key nothing
can be verified, and every message reaches the streams as a `Wake`: a cue to read the database,
whose content no stream shows."""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisError

from core.broker import open_live, split_live
from core.telemetry import LIVE_REJECTED

log = logging.getLogger(__name__)

_RETRY_S = 2.0
"""How long the hub waits between attempts to connect again while the broker is down."""
_SUBSCRIBE_S = 5.0
"""Longest wait for the broker to confirm a subscription (one that accepts connections but never
answers must not hang a stream)."""
_BACKLOG = 2000
"""Messages a stream may have waiting; a stream further behind (its client reads slowly) drops
them and catches up from the database instead of holding up the others or growing without end."""
_REJECT_LOG_S = 60.0
"""Dropped (unverified) messages are logged at most once this often per hub, with their count: a
flood of forgeries must not flood the log too."""


@dataclass(frozen=True, slots=True)
class Wake:
    """A message nobody vouches for (the API has no signing key): something changed on the
    channel, maybe. Streams read the database on it; `hint` is the message as decoded (a dict, or
    None), good for choosing which row to read and never for what a client is shown."""

    hint: dict[str, Any] | None = None


@functools.lru_cache(maxsize=64)
def _decode(payload: bytes) -> Any:
    """Decoded once per process; the streams share the result (read-only: no caller changes a
    message)."""
    return json.loads(payload)


class LiveChannel:
    """One stream's subscription to `channel`. `await next(timeout)` gives the next message or None
    (nothing within `timeout`, or the broker is down): a decoded dict that `signing_key` verified,
    or a `Wake` when there is no key. `resubscribed` turns True after a
    lost subscription came back, or when messages were dropped: the caller must catch up from the
    database, since whatever was published meanwhile is gone, and do so before it relays a newer
    message (whose ids would otherwise move its cursor past the gap: api/sse.py)."""

    def __init__(self, broker_url: str, channel: str, *, signing_key: bytes | None = None) -> None:
        self.url = broker_url
        self.channel = channel
        self.signing_key = signing_key
        self.resubscribed = False
        self.up = False
        """The channel is subscribed on a live connection."""
        self.was_down = False
        self._hub: _Hub | None = None
        self._queue: deque[Any] = deque()
        self._waiter: asyncio.Future[None] | None = None

    async def connect(self) -> bool:
        """Subscribe (once); False when the broker does not answer (the hub tries again)."""
        if self._hub is None:
            self._hub = _Hub.of(self.url, self.signing_key)
            await self._hub.add(self)
        return self.up

    async def next(self, timeout: float) -> dict[str, Any] | Wake | None:
        if self._hub is None:
            await self.connect()
        if not self._queue:
            loop = asyncio.get_running_loop()
            self._waiter = waiter = loop.create_future()
            timer = loop.call_later(timeout, _wake, waiter)
            try:
                await waiter
            finally:
                timer.cancel()
                self._waiter = None
        return self._queue.popleft() if self._queue else None

    async def close(self) -> None:
        hub, self._hub = self._hub, None
        self.up = False
        if hub is not None:
            await hub.remove(self)

    # called by the hub

    def _deliver(self, msg: Any) -> None:
        if len(self._queue) >= _BACKLOG:
            self._queue.clear()
            self.resubscribed = True  # the caller reads what it missed from the database
        self._queue.append(msg)
        _wake(self._waiter)

    def _subscribed(self) -> None:
        self.up = True
        if self.was_down:
            self.was_down = False
            self.resubscribed = True
            _wake(self._waiter)

    def _lost(self) -> None:
        self.up = False
        self.was_down = True
        _wake(self._waiter)


def _wake(waiter: asyncio.Future[None] | None) -> None:
    if waiter is not None and not waiter.done():
        waiter.set_result(None)


class _Hub:
    """The broker connection of one event loop for one broker URL: one SUBSCRIBE per channel,
    one task reading every message and handing it to the channel's streams. It goes away with its
    last stream."""

    _hubs: dict[tuple[int, str, bytes | None], _Hub] = {}

    @classmethod
    def of(cls, url: str, signing_key: bytes | None = None) -> _Hub:
        loop = asyncio.get_running_loop()
        key = (id(loop), url, signing_key)
        hub = cls._hubs.get(key)
        if hub is None or hub.loop is not loop:  # (a loop that ended with streams open)
            hub = cls._hubs[key] = _Hub(url, key, loop)
        return hub

    def __init__(self, url: str, key: tuple[int, str, bytes | None], loop: asyncio.AbstractEventLoop) -> None:
        self.url = url
        self.key = key
        self.signing_key = key[2]
        self.loop = loop
        self.rejected = 0
        """Messages dropped unverified since the last log line about them."""
        self.rejected_logged = float("-inf")
        self.subs: dict[str, set[LiveChannel]] = {}
        self.client: aioredis.Redis | None = None
        self.pubsub: aioredis.client.PubSub | None = None
        self.confirmed: set[str] = set()
        self.pending: dict[str, asyncio.Future[bool]] = {}
        self.task: asyncio.Task[None] | None = None
        self.kick = asyncio.Event()
        self.resubscribe: set[str] = set()
        """Channels the broker unsubscribed while streams still follow them (see _dispatch)."""
        self.next_try = 0.0
        self.warned = False

    # the streams' side

    async def add(self, sub: LiveChannel) -> None:
        channel = sub.channel
        streams = self.subs.setdefault(channel, set())
        streams.add(sub)
        if channel in self.confirmed:
            sub.up = True
            return
        waiting = self.pending.get(channel)
        if waiting is None:
            waiting = self.pending[channel] = asyncio.get_running_loop().create_future()
            if self.pubsub is not None:
                try:
                    await self.pubsub.subscribe(channel)
                except (RedisError, OSError) as e:
                    self._drop(e)
        if self.task is None:
            self.task = asyncio.get_running_loop().create_task(self._run())
        self.next_try = min(self.next_try, time.monotonic())  # a new stream: try the broker now
        self.kick.set()
        try:
            ok = await asyncio.wait_for(asyncio.shield(waiting), timeout=_SUBSCRIBE_S)
        except TimeoutError:
            ok = False
        # the channel as it stands now, not as it stood when the broker confirmed it: a connection
        # lost between the two has taken the subscription with it (up, the stream would poll the
        # database every 15 s instead of every second until the hub was back)
        if ok and sub in streams and channel in self.confirmed:
            sub.up = True
        else:
            sub.was_down = True

    async def remove(self, sub: LiveChannel) -> None:
        streams = self.subs.get(sub.channel)
        if streams is None:
            return
        streams.discard(sub)
        if streams:
            return
        del self.subs[sub.channel]
        self.confirmed.discard(sub.channel)
        self.pending.pop(sub.channel, None)
        if not self.subs:
            # the last stream: the connection goes with the reader; a new stream makes a new hub
            if self._hubs.get(self.key) is self:
                self._hubs.pop(self.key)
            if self.task is not None:
                self.task.cancel()
        elif self.pubsub is not None:
            try:
                await asyncio.wait_for(self.pubsub.unsubscribe(sub.channel), timeout=2)
            except (RedisError, OSError, TimeoutError) as e:
                self._drop(e)

    # the reader task

    async def _run(self) -> None:
        try:
            while self.subs and self._hubs.get(self.key) is self:
                if self.pubsub is None:
                    await self._connect()
                    continue
                try:
                    msg = await self.pubsub.get_message(timeout=1.0)
                except (RedisError, OSError, RuntimeError) as e:  # RuntimeError: dropped meanwhile
                    self._drop(e)
                    continue
                if msg is not None:
                    try:
                        self._dispatch(msg)
                    except Exception:  # noqa: BLE001 - the reader must outlive one bad message
                        # (a dead reader leaves every stream of the process `up` and deaf)
                        log.exception("streams: a message could not be handed out; skipped")
                if self.resubscribe and self.pubsub is not None:
                    channels, self.resubscribe = list(self.resubscribe), set()
                    try:
                        await self.pubsub.subscribe(*channels)
                    except (RedisError, OSError) as e:
                        self._drop(e)
        finally:
            self._settle_pending(False)
            await self._discard(self.client, self.pubsub)
            self.client = self.pubsub = None
            if self._hubs.get(self.key) is self:
                self._hubs.pop(self.key, None)

    async def _connect(self) -> None:
        wait = self.next_try - time.monotonic()
        if wait > 0:
            self.kick.clear()
            try:
                await asyncio.wait_for(self.kick.wait(), timeout=wait)
            except TimeoutError:
                pass
            return
        self.next_try = time.monotonic() + _RETRY_S
        # no retries inside redis-py: a connection it re-made by itself would resubscribe without
        # telling us, and the streams would never catch up on what was published meanwhile
        client = aioredis.Redis.from_url(self.url, socket_connect_timeout=2, retry=Retry(NoBackoff(), 0))
        pubsub = client.pubsub()
        channels = list(self.subs)
        try:
            await asyncio.wait_for(pubsub.subscribe(*channels), timeout=_SUBSCRIBE_S)
        except (RedisError, OSError, TimeoutError) as e:
            await self._discard(client, pubsub)
            self._warn(e)
            self._settle_pending(False)
            return
        self.client, self.pubsub = client, pubsub
        try:
            for ch in [c for c in self.subs if c not in channels]:  # added while we connected
                self.pending.setdefault(ch, asyncio.get_running_loop().create_future())
                await pubsub.subscribe(ch)
        except (RedisError, OSError) as e:
            self._drop(e)
            return
        if self.warned:
            log.warning("streams: the broker is back; subscribed again to %d channel(s)", len(self.subs))
            self.warned = False

    def _dispatch(self, msg: dict[str, Any]) -> None:
        kind = msg["type"]
        channel = msg["channel"]
        channel = channel.decode() if isinstance(channel, bytes) else channel
        if kind == "message":
            if channel not in self.subs:
                return
            body = self._open(channel, msg["data"])
            if body is None:
                return
            for sub in self.subs[channel]:
                sub._deliver(body)
        elif kind == "subscribe" and channel in self.subs:
            self.confirmed.add(channel)
            waiting = self.pending.pop(channel, None)
            if waiting is not None and not waiting.done():
                waiting.set_result(True)
            for sub in self.subs[channel]:
                sub._subscribed()
        elif kind == "unsubscribe" and channel in self.subs:
            # remove()'s UNSUBSCRIBE of a channel's last stream can reach the broker after the
            # SUBSCRIBE of a stream that came meanwhile (wait_for runs it as a task on 3.11): the
            # broker's last word is then "unsubscribed". Subscribe again; what was published in
            # between is gone, so the streams catch up from the database.
            self.confirmed.discard(channel)
            self.resubscribe.add(channel)
            for sub in self.subs[channel]:
                sub._lost()

    def _open(self, channel: str, data: bytes) -> dict[str, Any] | Wake | None:
        """What the streams get of one payload: its body when the hub's key verifies it for
        `channel`, a Wake when the hub has no key, None (dropped) otherwise. Verified once here,
        however many streams follow the channel."""
        if self.signing_key is None:
            parts = split_live(data)
            try:
                hint = _decode(parts[2] if parts else data)
            except (ValueError, RecursionError):
                hint = None
            return Wake(hint if isinstance(hint, dict) else None)
        body = open_live(self.signing_key, channel=channel, payload=data)
        if body is None:
            self._reject(channel, "unsigned" if split_live(data) is None else "bad_signature")
            return None
        try:
            decoded = _decode(body)
        except (ValueError, RecursionError):
            decoded = None
        if not isinstance(decoded, dict):
            self._reject(channel, "not_json")
            return None
        return decoded

    def _reject(self, channel: str, why: str) -> None:
        LIVE_REJECTED.labels(why).inc()
        self.rejected += 1
        now = time.monotonic()
        if now - self.rejected_logged >= _REJECT_LOG_S:
            log.warning(
                "streams: dropped %d live message(s) that did not verify (the last on %s: %s); "
                "someone without the signing key publishes on the broker",
                self.rejected,
                channel,
                why,
            )
            self.rejected, self.rejected_logged = 0, now

    def _drop(self, e: BaseException) -> None:
        """The connection failed: every stream follows the database until the hub is back."""
        self._warn(e)
        client, pubsub = self.client, self.pubsub
        self.client = self.pubsub = None
        self.confirmed.clear()
        self.next_try = time.monotonic()  # the first attempt at once, then every _RETRY_S
        for streams in self.subs.values():
            for sub in streams:
                sub._lost()
        self._settle_pending(False)
        if pubsub is not None:
            asyncio.get_running_loop().create_task(self._discard(client, pubsub))

    def _settle_pending(self, ok: bool) -> None:
        for waiting in self.pending.values():
            if not waiting.done():
                waiting.set_result(ok)
        self.pending.clear()

    def _warn(self, e: BaseException) -> None:
        if not self.warned:
            log.warning("streams: broker unavailable (%s); following the database", e)
            self.warned = True

    @staticmethod
    async def _discard(client: aioredis.Redis | None, pubsub: aioredis.client.PubSub | None) -> None:
        # closing a connection to a dead broker must neither raise nor wait
        for closeable in (pubsub, client):
            if closeable is None:
                continue
            try:
                await asyncio.wait_for(closeable.aclose(), timeout=2)
            except (RedisError, OSError, TimeoutError):
                pass
