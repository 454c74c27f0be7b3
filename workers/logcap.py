"""The trainer's own output (user code's prints, warnings, a traceback), per rank, bounded per
attempt: the first `head` lines go to the job's log as they come (stored, streamed live); past
that, only the last `tail` are kept, and at the attempt's end they follow a note of how many lines
were dropped between. A run that prints a line per step cannot fill the database, and a failure's
traceback (the last lines) is always kept.

torchrun's `--tee 2` prefixes each rank's stderr line with `[default<local rank>]:`; `split_rank`
takes that off and says the rank.
"""

from __future__ import annotations

import re
import threading
from collections import deque
from collections.abc import Callable

_PREFIX = re.compile(r"^\[(?:default|rank)(\d+)\]:")
MAX_LINE = 4000
"""Characters kept of one line (a progress bar's carriage returns can make a line of megabytes)."""


def split_rank(line: str) -> tuple[int | None, str]:
    m = _PREFIX.match(line)
    return (int(m.group(1)), line[m.end() :]) if m else (None, line)


Emit = Callable[[int | None, str, str], None]
"""emit(rank, stream, text)"""


class LogCap:
    """Thread-safe (the stdout and the stderr pump both add)."""

    def __init__(self, emit: Emit, *, head: int, tail: int) -> None:
        self.emit, self.head = emit, head
        self.seen = 0
        self._tail: deque[tuple[int | None, str, str]] = deque(maxlen=tail)
        self._lock = threading.Lock()

    def add(self, *, rank: int | None, stream: str, text: str) -> None:
        text = text.rstrip()[:MAX_LINE]
        if not text:
            return
        with self._lock:
            self.seen += 1
            if self.seen > self.head:
                self._tail.append((rank, stream, text))
                return
        self.emit(rank, stream, text)

    def dropped(self) -> int:
        return max(0, self.seen - self.head - len(self._tail))

    def close(self) -> None:
        """Emit the note and the tail (once)."""
        with self._lock:
            tail, dropped = list(self._tail), self.dropped()
            self._tail.clear()
        if dropped:
            self.emit(
                None,
                "note",
                f"[{dropped} line(s) of output dropped here: the log keeps the first and last lines]",
            )
        for rank, stream, text in tail:
            self.emit(rank, stream, text)
