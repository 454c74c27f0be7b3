"""Reading the API's Server-Sent Events for as long as the caller reads, across dropped
connections and API restarts.

The API names each frame that moves a stream's cursor with an `id:` (api/sse.py: `m<point>e<event>`
for a job, api/selection_stream.py: `m<point>` for a batch). After a drop we reconnect with the last
id as Last-Event-ID and the API replays exactly what we had not seen. Frames without an id (a
batch's trial states, a live log line past the stored head) are state or live-only: they are not
replayed. An `error` frame ends the stream for good (the token was revoked)."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import httpx

from shardyard.errors import ApiError, ShardyardError, raise_for

log = logging.getLogger("shardyard")
_TRANSIENT = (429, 502, 503, 504)


END = "end-of-stream"
"""The event of the Frame `frames` yields when the server closed the stream cleanly."""


@dataclass(frozen=True, slots=True)
class Frame:
    id: str | None
    event: str
    data: Any


class StreamTimeout(ShardyardError, TimeoutError):
    """wait(..., timeout=) ran out before the job or batch ended."""


class _Interrupted(Exception):
    """The stream ended or the server asked us to come back later."""


def _say_interrupted(reason: str) -> None:
    log.warning("stream interrupted (%s); reconnecting...", reason)


def _say_resumed() -> None:
    log.warning("stream resumed")


def frames(
    http: httpx.Client,
    path: str,
    *,
    patience_s: float,
    deadline: float | None = None,
    on_interrupt: Callable[[str], None] | None = None,
    on_resume: Callable[[], None] | None = None,
) -> Iterator[Frame]:
    """The stream's frames until the caller stops reading (or the stream ends in an `error`
    frame: ApiError), and an END frame each time the server closes the stream. A drop, a stream
    that ends, or a 429/5xx is followed by a reconnect with Last-Event-ID after a back-off (0.5 s
    doubling to 5 s); after `patience_s` without getting through, ShardyardError. `deadline`
    (time.monotonic()): StreamTimeout once it passes."""
    interrupted = on_interrupt or _say_interrupted
    resumed = on_resume or _say_resumed
    last_id: str | None = None
    delay, down_since = 0.5, None
    while True:
        headers = {"Last-Event-ID": last_id} if last_id else {}
        read_s = None if deadline is None else max(0.5, deadline - time.monotonic())
        try:
            with http.stream("GET", path, headers=headers, timeout=httpx.Timeout(30, read=read_s)) as resp:
                if resp.status_code in _TRANSIENT:
                    resp.read()
                    raise _Interrupted(f"{resp.status_code}: {resp.text[:200]}")
                if resp.status_code >= 400:
                    resp.read()
                    raise_for(resp)
                for f in _parse(resp.iter_lines(), deadline=deadline):
                    if f.event == "error":
                        # the server ended the stream for good (the token was revoked)
                        data = f.data if isinstance(f.data, dict) else {}
                        raise ApiError(
                            f"stream {path}: {data.get('detail')}", status=int(data.get("status") or 401)
                        )
                    last_id = f.id or last_id
                    if down_since is not None:
                        resumed()
                    delay, down_since = 0.5, None
                    yield f
                # the server ended the stream: the caller stops here once its job or batch has
                # ended; otherwise (the API is going down) we reconnect
                yield Frame(id=None, event=END, data=None)
            raise _Interrupted("the server closed the stream")
        except (httpx.TransportError, _Interrupted) as e:
            now = time.monotonic()
            if deadline is not None and now >= deadline:
                raise StreamTimeout(f"stream {path}: the wait ran out") from e
            reason = str(e) or type(e).__name__
            if down_since is None:
                down_since = now
                interrupted(reason)
            elif now - down_since > patience_s:
                raise ShardyardError(f"lost the stream {path} for {patience_s:.0f}s: {reason}") from e
            time.sleep(delay if deadline is None else min(delay, max(0.0, deadline - now)))
            delay = min(2 * delay, 5.0)


def _parse(lines: Iterator[str], *, deadline: float | None) -> Iterator[Frame]:
    """Frames as each one ends (comments and keep-alives skipped, but they let `deadline` be
    checked while a stream is quiet)."""
    fid: str | None = None
    event, data = "message", list[str]()
    for line in lines:
        if deadline is not None and time.monotonic() >= deadline:
            raise httpx.ReadTimeout("the wait ran out")
        if line == "":
            if data:
                yield Frame(id=fid, event=event, data=json.loads("\n".join(data)))
            fid, event, data = None, "message", []
        elif line.startswith("id:"):
            fid = line[3:].strip()
        elif line.startswith("event:"):
            event = line[6:].strip()
        elif line.startswith("data:"):
            data.append(line[5:].strip())
