"""The streams of one API process share one broker connection (api/live.py): one SUBSCRIBE per
channel however many streams follow it, each message read once and handed to all of them; the
last stream to leave a channel unsubscribes it; and a redis-server restart leaves every stream
marked `resubscribed` (so it catches up from the database) with messages flowing again."""

from __future__ import annotations

import asyncio
import json
import time

import pytest
import redis

from api.live import _BACKLOG, LiveChannel, _Hub
from api.stack import Stack
from core.broker import sign_live

KEY = b"test-hub-key"
"""The streams verify what they are handed (api/live.py); these tests publish as the service does."""


def _numsub(url: str, channel: str) -> int:
    with redis.Redis.from_url(url) as r:
        return dict(r.pubsub_numsub(channel))[channel.encode()]


def _pubsub_clients(url: str) -> int:
    with redis.Redis.from_url(url) as r:
        return sum(1 for c in r.client_list() if int(c.get("sub", 0)) > 0)


def _publish(url: str, channel: str, body: dict) -> None:
    with redis.Redis.from_url(url) as r:
        r.publish(channel, sign_live(KEY, channel=channel, body=json.dumps(body).encode()))


async def _until(check, timeout: float = 15.0) -> None:  # noqa: ANN001
    deadline = asyncio.get_running_loop().time() + timeout
    while not check():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.05)


def test_streams_on_one_channel_share_one_subscription_and_the_last_unsubscribes(broker: Stack) -> None:
    url = broker.broker_url

    async def main() -> None:
        streams = [LiveChannel(url, "job:1", signing_key=KEY) for _ in range(20)]
        other = LiveChannel(url, "job:2", signing_key=KEY)
        for s in [*streams, other]:
            assert await s.connect()
        assert _numsub(url, "job:1") == 1 and _numsub(url, "job:2") == 1
        assert _pubsub_clients(url) == 1  # one connection for both channels
        await asyncio.to_thread(_publish, url, "job:1", {"type": "metrics", "n": 1})
        got = await asyncio.gather(*(s.next(timeout=5) for s in streams))
        assert got[0] == {"type": "metrics", "n": 1}
        assert all(g is got[0] for g in got)  # decoded once, the same object for every stream
        assert await other.next(timeout=0.2) is None  # nothing published on its channel
        # one stream gone: the channel stays subscribed for the others
        await streams.pop().close()
        assert _numsub(url, "job:1") == 1
        for s in streams:
            await s.close()
        await _until(lambda: _numsub(url, "job:1") == 0)
        assert _numsub(url, "job:2") == 1
        await other.close()
        await _until(lambda: _pubsub_clients(url) == 0)
        assert not _Hub._hubs

    asyncio.run(main())


def test_a_broker_restart_resubscribes_every_stream_and_says_so(broker: Stack) -> None:
    url = broker.broker_url

    async def main() -> None:
        streams = [LiveChannel(url, "job:7", signing_key=KEY) for _ in range(5)]
        for s in streams:
            assert await s.connect()
        await asyncio.to_thread(broker.stop_process, "redis")
        # the streams learn of it at their next read (and then follow the database)
        for s in streams:
            await s.next(timeout=1.5)
        assert not any(s.up for s in streams)
        assert not any(s.resubscribed for s in streams)
        await asyncio.to_thread(broker.start_redis)

        async def read_all() -> None:
            for s in streams:
                while not s.resubscribed:
                    await s.next(timeout=0.5)

        await asyncio.wait_for(read_all(), timeout=20)
        assert all(s.up for s in streams)
        assert _numsub(url, "job:7") == 1 and _pubsub_clients(url) == 1
        await asyncio.to_thread(_publish, url, "job:7", {"type": "event", "id": 3})
        got = await asyncio.gather(*(s.next(timeout=5) for s in streams))
        assert got == [{"type": "event", "id": 3}] * 5
        for s in streams:
            await s.close()

    asyncio.run(main())


def test_a_stream_opened_while_the_broker_is_down_subscribes_once_it_is_back(broker: Stack) -> None:
    url = broker.broker_url
    broker.stop_process("redis")

    async def main() -> None:
        s = LiveChannel(url, "job:9", signing_key=KEY)
        assert not await s.connect()
        assert await s.next(timeout=0.2) is None
        await asyncio.to_thread(broker.start_redis)
        deadline = asyncio.get_running_loop().time() + 20
        while not s.resubscribed:
            assert asyncio.get_running_loop().time() < deadline
            await s.next(timeout=0.5)
        assert s.up and _numsub(url, "job:9") == 1
        await s.close()

    asyncio.run(main())


def test_a_stream_too_far_behind_drops_its_backlog_and_catches_up() -> None:
    s = LiveChannel("redis://unused", "job:3")
    for i in range(_BACKLOG + 5):
        s._deliver({"i": i})
    assert s.resubscribed
    assert len(s._queue) == 5
    assert asyncio.run(s.next(timeout=0)) == {"i": _BACKLOG}


def test_a_message_that_is_not_json_is_skipped_and_the_stream_goes_on(broker: Stack) -> None:
    url = broker.broker_url

    async def main() -> None:
        s = LiveChannel(url, "job:4", signing_key=KEY)
        assert await s.connect()
        await asyncio.to_thread(
            lambda: redis.Redis.from_url(url).publish(
                "job:4", sign_live(KEY, channel="job:4", body=b"not json")
            )
        )
        await asyncio.to_thread(_publish, url, "job:4", {"type": "event", "id": 1})
        assert await s.next(timeout=5) == {"type": "event", "id": 1}
        await s.close()

    asyncio.run(main())


def test_a_stream_that_opens_while_the_last_one_on_its_channel_closes_still_hears_it(broker: Stack) -> None:
    url = broker.broker_url

    async def main() -> None:
        keep = LiveChannel(url, "job:2", signing_key=KEY)  # keeps the hub (and its connection) alive
        first = LiveChannel(url, "job:1", signing_key=KEY)
        assert await keep.connect() and await first.connect()
        second = LiveChannel(url, "job:1", signing_key=KEY)
        # the last stream on job:1 leaves as a new one comes: the channel must end up subscribed
        await asyncio.gather(first.close(), second.connect())
        await _until(lambda: second.up and _numsub(url, "job:1") == 1, timeout=5)
        await asyncio.to_thread(_publish, url, "job:1", {"type": "event", "id": 5})
        assert await second.next(timeout=5) == {"type": "event", "id": 5}
        await second.close()
        await keep.close()

    asyncio.run(main())


def test_a_message_that_breaks_the_decoder_does_not_silence_the_channel(broker: Stack) -> None:
    url = broker.broker_url

    async def main() -> None:
        s = LiveChannel(url, "job:6", signing_key=KEY)
        assert await s.connect()
        # valid JSON too deep for json.loads: RecursionError, not ValueError
        deep = b"[" * 200_000 + b"]" * 200_000
        await asyncio.to_thread(
            lambda: redis.Redis.from_url(url).publish("job:6", sign_live(KEY, channel="job:6", body=deep))
        )
        await asyncio.to_thread(_publish, url, "job:6", {"type": "event", "id": 2})
        assert await s.next(timeout=5) == {"type": "event", "id": 2}
        await s.close()

    asyncio.run(main())


def test_a_connection_lost_just_after_the_subscription_leaves_the_stream_down(
    broker: Stack, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The broker confirms the channel, then the connection fails before the stream that waited
    for it resumes. The stream must come back down (following the database every second), not up
    on a connection that is gone (it then polled every 15 s until the hub was back)."""
    url = broker.broker_url
    dispatch = _Hub._dispatch
    injected: list[str] = []

    def confirm_then_fail(self: _Hub, msg: dict) -> None:
        dispatch(self, msg)
        if msg["type"] == "subscribe" and not injected:
            injected.append(msg["channel"])
            self._drop(ConnectionError("injected: lost right after SUBSCRIBE"))
            self.next_try = time.monotonic() + 1.0  # the hub is back a second later

    monkeypatch.setattr(_Hub, "_dispatch", confirm_then_fail)

    async def main() -> None:
        s = LiveChannel(url, "job:11", signing_key=KEY)
        assert not await s.connect() and not s.up and injected
        while not s.resubscribed:  # the hub subscribes again and the stream catches up
            await asyncio.wait_for(s.next(timeout=0.5), timeout=20)
        assert s.up and _numsub(url, "job:11") == 1
        await s.close()

    asyncio.run(main())
