"""Slow requests, explained in the log: when a request has waited longer than `stall_log_s`
(SHARDYARD_STALL_LOG_S; 0 turns it off), the API process logs once what every one of its threads
is doing at that moment, and whether its event loop is still turning.

A tail that only shows up under load is hard to catch after the fact: the latency histogram says a
request took 4 s, not where it waited. The stacks say it: a request thread inside SQLite's
`execute` waits for the database's write lock (another process holds it), one inside the pool's
`checkout` for a connection (this process holds them all), a loop that has not turned is blocked
by code running on it. One report per episode: a new one only after every request that was slow
has ended.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import sys
import threading
import time
import traceback

log = logging.getLogger("shardyard.api.stalls")

CHECK_S = 0.25
"""How often the watch looks; a stall is reported within `stall_log_s` + CHECK_S."""


class StallWatch:
    def __init__(self, after_s: float) -> None:
        self.after_s = after_s
        self.inflight: dict[int, tuple[float, str]] = {}
        self.ids = itertools.count()
        self.loop_beat = time.monotonic()
        self.reported = False
        self.reports = 0
        self._stop = threading.Event()

    def begin(self, what: str) -> int:
        key = next(self.ids)
        self.inflight[key] = (time.monotonic(), what)
        return key

    def end(self, key: int) -> None:
        self.inflight.pop(key, None)

    async def beat(self) -> None:
        """Runs on the event loop: its beat going stale means the loop is blocked."""
        while True:
            self.loop_beat = time.monotonic()
            await asyncio.sleep(CHECK_S)

    def start(self) -> StallWatch:
        """Look every CHECK_S on a daemon thread of its own until `stop`."""

        def watch() -> None:
            while not self._stop.wait(CHECK_S):
                self.check()

        threading.Thread(target=watch, daemon=True, name="stall-watch").start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def check(self) -> str | None:
        """Log a report if a request or the loop has been stuck past `after_s`; the report, or None."""
        now = time.monotonic()
        slow = sorted(
            ((now - t, what) for t, what in list(self.inflight.values()) if now - t > self.after_s),
            reverse=True,
        )
        if not slow:
            self.reported = False
            return None
        if self.reported:
            return None
        loop_late = now - self.loop_beat
        self.reported = True
        self.reports += 1
        head = ", ".join(f"{what} {age:.1f} s" for age, what in slow[:5])
        loop = (
            f"the event loop has not turned for {loop_late:.1f} s"
            if loop_late > 2 * CHECK_S + 0.5
            else "the event loop turns"
        )
        names = {t.ident: t.name for t in threading.enumerate()}
        stacks = []
        for ident, frame in sys._current_frames().items():  # noqa: SLF001 - the documented way
            if ident == threading.get_ident():
                continue
            stack = "".join(traceback.format_stack(frame, limit=12))
            stacks.append(f"-- thread {names.get(ident, ident)}:\n{stack}")
        report = (
            f"{len(slow)} request(s) waiting over {self.after_s:g} s ({head}); {loop}; "
            f"{len(self.inflight)} in flight. Every thread now:\n" + "\n".join(stacks)
        )
        log.warning("%s", report)
        return report
