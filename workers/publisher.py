"""Live publishing off the database path: the relay hands each message to a publisher thread and
goes on; Redis being down or hung never holds up a database write or a lease renewal.

Publishing is best effort. The dashboard's streams read the database as the source of truth and
catch up from it when they subscribe again (api/streams.py, api/selection_stream.py), so a message
dropped here costs latency, never a point. One publisher per worker process and broker: a single
thread, so messages keep their order. When a publish fails (refused, or no answer within the
socket timeout) the message is dropped with everything queued behind it, and for `pause_s` new
messages are dropped at once instead of each waiting out the timeout again.

With a signing key (SHARDYARD_BROKER_SIGNING_KEY) each message is signed for each of its channels
(core/broker.py sign_live: HMAC-SHA256, some microseconds per message, on this thread, never the
relay's); the API shows no message it cannot verify.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import threading
import time
from collections import deque
from typing import Any

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from core.broker import broker_signing_key, sign_live
from core.settings import Settings

log = logging.getLogger(__name__)

SOCKET_TIMEOUT_S = 2.0


class LivePublisher:
    def __init__(
        self,
        broker_url: str,
        *,
        signing_key: bytes | None = None,
        max_pending: int = 20_000,
        pause_s: float = 1.0,
    ) -> None:
        self._key = signing_key
        # one retry, on a refused or reset connection only (a pooled connection from before a
        # redis-server restart); a hung server is not asked twice
        self._redis = redis.Redis.from_url(
            broker_url,
            socket_connect_timeout=SOCKET_TIMEOUT_S,
            socket_timeout=SOCKET_TIMEOUT_S,
            retry=Retry(NoBackoff(), 1, supported_errors=(redis.ConnectionError,)),
        )
        self._queue: deque[tuple[bytes, tuple[str, ...]]] = deque()
        self._max_pending = max_pending
        self._pause_s = pause_s
        self._paused_until = 0.0
        self._busy = False
        self._cond = threading.Condition()
        self.dropped = 0
        self._thread = threading.Thread(target=self._run, daemon=True, name="live-publisher")
        self._thread.start()

    def send(self, msg: dict[str, Any], *, channels: tuple[str, ...]) -> None:
        """Queue `msg` for `channels`; never blocks, never raises."""
        payload = json.dumps(msg, separators=(",", ":")).encode()
        with self._cond:
            if time.monotonic() < self._paused_until or len(self._queue) >= self._max_pending:
                self.dropped += 1
                return
            self._queue.append((payload, channels))
            self._cond.notify_all()

    def drain(self, timeout_s: float) -> bool:
        """Wait up to `timeout_s` until everything queued so far went out (or was dropped)."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while self._queue or self._busy:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue:
                    self._cond.wait()
                payload, channels = self._queue.popleft()
                self._busy = True
            try:
                for ch in channels:
                    # signed per channel: the channel is under the MAC, so a copy on another
                    # job's channel does not verify there
                    out = payload if self._key is None else sign_live(self._key, channel=ch, body=payload)
                    self._redis.publish(ch, out)
            except Exception as e:  # noqa: BLE001 - the database has it; live delivery is best effort
                with self._cond:
                    self.dropped += 1 + len(self._queue)
                    self._queue.clear()
                    self._paused_until = time.monotonic() + self._pause_s
                log.warning("live publishing paused for %.0fs (broker: %s)", self._pause_s, e)
            finally:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()


@functools.cache
def _publisher(pid: int, broker_url: str, signing_key: bytes | None) -> LivePublisher:
    return LivePublisher(broker_url, signing_key=signing_key)


def live_publisher(settings: Settings) -> LivePublisher:
    """This process's publisher for the settings' broker, signing with their key (a forked pool
    process gets its own thread)."""
    return _publisher(os.getpid(), settings.broker_url, broker_signing_key(settings))
