"""The trainer's own output (user code's prints, warnings, a traceback), per rank, bounded per
attempt: the first `head` lines go to the job's log as they come (stored, streamed live); past
that, only the last `tail` are kept, and at the attempt's end they follow a note of how many lines
were dropped between. Lines past the head still go out live (`live`, not stored; at most
`live_per_s` a second), each with the time it was read, so a page that showed one live does not
show it twice when the tail is stored. A run that prints a line per step cannot fill the database, and a failure's
traceback (the last lines) is always kept.

torchrun's `--tee 2` prefixes each rank's stderr line with `[default<local rank>]:`; `split_rank`
takes that off and says the rank.
"""

from __future__ import annotations

import re
import threading
import time
from collections import deque
from collections.abc import Callable

_PREFIX = re.compile(r"^\[(?:default|rank)(\d+)\]:")
MAX_LINE = 4000
"""Characters kept of one line (a progress bar's carriage returns can make a line of megabytes)."""


def split_rank(line: str) -> tuple[int | None, str]:
    m = _PREFIX.match(line)
    return (int(m.group(1)), line[m.end() :]) if m else (None, line)


Emit = Callable[[int | None, str, str, float], None]
"""emit(rank, stream, text, time)"""


class LogCap:
    """Thread-safe (the stdout and the stderr pump both add)."""

    def __init__(
        self, emit: Emit, *, head: int, tail: int, live: Emit | None = None, live_per_s: int = 50
    ) -> None:
        self.emit, self.head, self.live = emit, head, live
        self.seen = 0
        self.live_dropped = 0
        self._tail: deque[tuple[int | None, str, str, float]] = deque(maxlen=tail)
        self._lock = threading.Lock()
        self._live_per_s = live_per_s
        self._second, self._sent = 0, 0

    def add(self, *, rank: int | None, stream: str, text: str) -> None:
        text = text.rstrip()[:MAX_LINE]
        if not text:
            return
        at = time.time()
        with self._lock:
            self.seen += 1
            if self.seen <= self.head:
                send = self.emit
            else:
                self._tail.append((rank, stream, text, at))
                # a flood of output must not flood the broker: a few lines a second go out live
                if int(at) != self._second:
                    self._second, self._sent = int(at), 0
                if self.live is None or self._sent >= self._live_per_s:
                    self.live_dropped += 1
                    return
                self._sent += 1
                send = self.live
        send(rank, stream, text, at)

    def dropped(self) -> int:
        return max(0, self.seen - self.head - len(self._tail))

    def close(self) -> None:
        """Emit the note and the tail (once)."""
        with self._lock:
            tail, dropped = list(self._tail), self.dropped()
            self._tail.clear()
        if dropped:
            at = tail[0][3] if tail else time.time()
            note = f"[{dropped} line(s) of output dropped here: the log keeps the first and last lines]"
            self.emit(None, "note", note, at)
        for rank, stream, text, at in tail:
            self.emit(rank, stream, text, at)
