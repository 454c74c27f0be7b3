"""api/stalls.py on real threads: a request stuck behind a blocked event loop is reported with the
loop named as the cause and the blocking frame in the stacks, once per episode; quick requests are
never reported. (The SQLite write-lock case runs against the real API in
tests/integration/test_api_faults.py.)"""

from __future__ import annotations

import asyncio
import threading
import time

from api.stalls import StallWatch


def _hold_the_loop_for(seconds: float) -> None:
    time.sleep(seconds)


def test_a_blocked_event_loop_is_named_with_the_frame_that_blocks_it() -> None:
    # a wide margin on each side of after_s: a loaded machine may wake this thread late
    watch = StallWatch(after_s=1.5)
    loop = asyncio.new_event_loop()
    ready = threading.Event()

    def run() -> None:
        asyncio.set_event_loop(loop)
        loop.create_task(watch.beat())
        loop.call_soon(ready.set)
        loop.run_forever()

    t = threading.Thread(target=run, daemon=True, name="the-loop")
    t.start()
    try:
        ready.wait(5)
        time.sleep(0.3)
        key = watch.begin("GET /api/jobs")
        loop.call_soon_threadsafe(_hold_the_loop_for, 5.0)
        time.sleep(0.3)
        assert watch.check() is None  # not late yet
        time.sleep(2.2)
        report = watch.check()
        assert report is not None
        assert "1 request(s) waiting over 1.5 s (GET /api/jobs" in report
        assert "the event loop has not turned for" in report
        assert "thread the-loop" in report and "_hold_the_loop_for" in report
        assert watch.check() is None  # one report per episode
        watch.end(key)
        assert watch.check() is None and not watch.reported  # the episode is over
        assert watch.reports == 1
    finally:
        loop.call_soon_threadsafe(loop.stop)
        t.join(10)


def test_quick_requests_are_never_reported() -> None:
    watch = StallWatch(after_s=0.2)
    for _ in range(50):
        watch.end(watch.begin("POST /api/jobs"))
    time.sleep(0.3)
    assert watch.check() is None and watch.inflight == {}
