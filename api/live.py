"""A Redis pub/sub subscription for one stream that outlives the broker: when redis-server goes
away (restart, network) the stream keeps going on database polls and subscribes again once the
broker answers. Live messages are only a fast path; the database has everything they carried."""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import time
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import RedisError

log = logging.getLogger(__name__)

_RETRY_S = 2.0
"""How long a stream waits between attempts to subscribe again while the broker is down."""


@functools.lru_cache(maxsize=64)
def _decode(payload: bytes) -> Any:
    """Every stream on a channel receives the same payload: decoded once per process, and the
    streams share the result (read-only: no caller changes a message)."""
    return json.loads(payload)


class LiveChannel:
    """`await next(timeout)` gives the next decoded message or None (nothing within `timeout`, or
    the broker is down). `resubscribed` turns True after a lost subscription came back: the
    caller must catch up from the database, since whatever was published meanwhile is gone."""

    def __init__(self, broker_url: str, channel: str) -> None:
        self._url = broker_url
        self._channel = channel
        self._client: aioredis.Redis | None = None
        self._pubsub: aioredis.client.PubSub | None = None
        self._next_try = 0.0
        self._was_down = False
        self.resubscribed = False

    @property
    def up(self) -> bool:
        return self._pubsub is not None

    async def connect(self) -> bool:
        """Subscribe (once); False when the broker does not answer (tried again later)."""
        if self._pubsub is not None:
            return True
        self._next_try = time.monotonic() + _RETRY_S
        client = aioredis.Redis.from_url(self._url, socket_connect_timeout=2)
        pubsub = client.pubsub()
        try:
            # bounded: a broker that accepts connections but never answers must not hang a stream
            await asyncio.wait_for(pubsub.subscribe(self._channel), timeout=5)
        except (RedisError, OSError, TimeoutError) as e:
            await self._discard(client, pubsub)
            if not self._was_down:
                log.warning("stream on %s: broker unavailable (%s); following the database", self._channel, e)
            self._was_down = True
            return False
        self._client, self._pubsub = client, pubsub
        if self._was_down:
            self.resubscribed = True
            self._was_down = False
        return True

    async def next(self, timeout: float) -> dict[str, Any] | None:
        if self._pubsub is None and (time.monotonic() < self._next_try or not await self.connect()):
            await asyncio.sleep(timeout)
            return None
        assert self._pubsub is not None
        try:
            msg = await self._pubsub.get_message(ignore_subscribe_messages=True, timeout=timeout)
        except (RedisError, OSError) as e:
            log.warning("stream on %s: lost the broker (%s); following the database", self._channel, e)
            await self._discard(self._client, self._pubsub)
            self._client = self._pubsub = None
            self._was_down = True
            return None
        return _decode(msg["data"]) if msg is not None else None

    async def close(self) -> None:
        await self._discard(self._client, self._pubsub)
        self._client = self._pubsub = None

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
