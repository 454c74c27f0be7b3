"""Server-Sent Events for a selection batch: its trials' states, then their metrics, resumable.

The event id of a `metric` frame is a cursor over the batch's metric points, `m<last point id>`.
A client that reconnects with Last-Event-ID gets the trials' current states again (`trial`
frames carry no id: they are state, not history) and then exactly the points it has not seen.

The points come from the database, in id order, never from the channel's payload: the relays of
a batch's groups (on different workers) commit one after the other under the batch's row lock
(db/selections.py lock_selection_writes), so the committed points of a batch are always a prefix
in id order and one cursor is exact; their live messages, though, may arrive in another order.
A `metrics` message on the channel only wakes the stream, which then reads what is new (at most
every `_READ_EVERY_S`); while the broker is down the stream polls the database once a second.

A `trial` message the service signed (api/live.py verifies it) is sent as it is; the batch's status
only ever comes from the database: a `selection` message, or any unverified one (a `Wake`, when
the API has no signing key), has the stream read the batch's state and points, and the stream
ends when that read says the batch is over.
"""

from __future__ import annotations

import re
import time
from collections.abc import AsyncIterator
from typing import Any

from sqlalchemy.exc import SQLAlchemyError

from api.convert import selection_public
from api.live import LiveChannel, Wake
from api.sse import frame
from api.stream_threads import in_stream_thread
from core.broker import broker_signing_key, selection_channel
from core.settings import Settings
from db.connection import session_for
from db.models import TERMINAL
from db.selections import get_selection, selection_points_after

_CURSOR = re.compile(r"^m(\d+)$")
_REPLAY_CHUNK = 5000
_READ_EVERY_S = 0.25


def parse_cursor(raw: str | None) -> int:
    m = _CURSOR.match(raw or "")
    return int(m[1]) if m else 0


def _snapshot(settings: Settings, selection_id: int) -> tuple[str, list[dict[str, Any]]]:
    with session_for(settings.database_url) as s:
        sel = selection_public(get_selection(s, selection_id)).model_dump(mode="json")
    return sel["status"], sel["trials"]


def _points(settings: Settings, selection_id: int, after: int) -> list[tuple]:
    with session_for(settings.database_url) as s:
        return selection_points_after(s, selection_id=selection_id, after_id=after, limit=_REPLAY_CHUNK)


class _Reader:
    """The stream's cursor and the frames of the points after it."""

    def __init__(self, settings: Settings, selection_id: int, cursor: int) -> None:
        self.settings, self.selection_id, self.cursor = settings, selection_id, cursor
        self.last_read = 0.0

    async def frames(self) -> list[str]:
        out: list[str] = []
        self.last_read = time.monotonic()
        while True:
            rows = await in_stream_thread(_points, self.settings, self.selection_id, self.cursor)
            for pid, job_id, step, name, value, t, trial_id in rows:
                self.cursor = pid
                data = {
                    "trial_id": trial_id,
                    "job_id": job_id,
                    "step": step,
                    "name": name,
                    "value": value,
                    "time": t,
                }
                out.append(frame(event="metric", data=data, cursor=f"m{pid}"))
            if len(rows) < _REPLAY_CHUNK:
                return out


async def selection_events(
    settings: Settings, *, selection_id: int, last_event_id: str | None = None
) -> AsyncIterator[str]:
    reader = _Reader(settings, selection_id, parse_cursor(last_event_id))
    live = LiveChannel(
        settings.broker_url, selection_channel(selection_id), signing_key=broker_signing_key(settings)
    )
    try:
        # subscribe before the first read, so nothing published in between is missed
        await live.connect()
        yield "retry: 2000\n\n"
        status, trials = await in_stream_thread(_snapshot, settings, selection_id)
        for t in trials:
            yield frame(event="trial", data=t)
        yield frame(event="status", data={"status": status})
        for f in await reader.frames():
            yield f
        if status in TERMINAL:
            return
        last_sent = last_state = time.monotonic()
        shown = {t["id"]: t for t in trials}  # each trial as the client last saw it while polling
        dirty = False
        # a message asked for the batch's state from the database (read at most every _READ_EVERY_S)
        state_due = False
        while True:
            body = await live.next(timeout=_READ_EVERY_S if dirty or state_due else 1.0)
            now = time.monotonic()
            out: list[str] = []
            ended = False
            if isinstance(body, Wake) or (body is not None and body.get("type") == "selection"):
                # unverified, or the batch's status: either way the database says what it is
                body, dirty, state_due = None, True, True
            # resubscribed: what was published while the broker was down is gone, so send the
            # state again; the broker down: no message tells of a change, so poll for one
            again = live.resubscribed
            polled = not live.up and now - last_state >= 1.0
            if again or polled or (state_due and now - last_state >= _READ_EVERY_S):
                live.resubscribed, last_state = False, now
                try:
                    now_status, trials = await in_stream_thread(_snapshot, settings, selection_id)
                except SQLAlchemyError:
                    live.resubscribed = again  # try again on the next round
                else:
                    state_due = False
                    out += [frame(event="trial", data=t) for t in trials if again or shown.get(t["id"]) != t]
                    if again or now_status != status:
                        out.append(frame(event="status", data={"status": now_status}))
                    shown = {t["id"]: t for t in trials}
                    status = now_status
                    dirty, ended = True, status in TERMINAL
            if body is not None:
                if body.get("type") == "metrics":
                    dirty = True
                elif body.get("type") == "trial":
                    out.append(frame(event="trial", data=body["trial"]))
            if not live.up:
                dirty = True  # no wake-ups while the broker is away: poll the database
            if dirty and (ended or now - reader.last_read >= (_READ_EVERY_S if live.up else 1.0)):
                try:
                    points = await reader.frames()
                except SQLAlchemyError:
                    points = []  # the database is busy: the next round reads again
                else:
                    dirty = False
                # the points before the status frame that ends the batch
                out = points + out if ended else out + points
            for f in out:
                yield f
            if out:
                last_sent = now
            if ended:
                return
            if now - last_sent > settings.sse_keepalive_s:
                last_sent = now
                yield ": keep-alive\n\n"
    finally:
        await live.close()
