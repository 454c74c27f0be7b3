"""Server-Sent Events for one job: replay what the client missed from the database, then relay the
job's Redis channel live.

The event id is a cursor over both tables, `m<last metric id>e<last event id>`, so a client that
reconnects with Last-Event-ID gets exactly the points and events it has not seen. The worker
writes rows first and publishes their ids after, so everything on the channel is also in the
database: we subscribe *before* replaying and drop channel messages the replay already covered.

A job's events have several writers (the worker's relay, the API's cancel, the scheduler's logs),
each publishing after its own commit, so their ids can reach the channel out of order: the
cancel's 101 before the relay's 100. The cursor keeps the highest id sent, and beside it the ids
this stream has sent (`Cursor.sent`), so an event below the cursor that it has not sent still goes
out (under the cursor's id, which does not move back). What remains: a client that reconnects
after the higher id reached it and before the lower one was published resumes past the lower one
and never gets it (each event is published once); the window is one writer's commit-to-publish
time.

A stream holds no database connection while it waits: each read is its own short session. When the
broker goes away the stream polls the database instead and subscribes again once it is back, so a
redis-server restart costs the client latency, never a point.
"""

from __future__ import annotations

import json
import logging
import re
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy.exc import SQLAlchemyError
from starlette.concurrency import run_in_threadpool

from api.live import LiveChannel
from core.broker import job_channel
from core.settings import Settings
from db.engine import session_for
from db.jobs import events_after, get_job, metrics_after
from db.models import TERMINAL

log = logging.getLogger(__name__)
_CURSOR = re.compile(r"^m(\d+)e(\d+)$")
_REPLAY_CHUNK = 5000
_DB_RECHECK_S = 15.0


_SENT_KEPT = 4096


@dataclass(slots=True)
class Cursor:
    metric: int = 0
    event: int = 0
    sent: set[int] = field(default_factory=set, compare=False, repr=False)
    """Event ids this stream has sent (the newest _SENT_KEPT); below `floor` counts as sent."""
    floor: int = 0

    def takes_event(self, event_id: int) -> bool:
        """Whether an event is new to this stream: above the cursor, or below it but not sent yet
        (another writer's, published late); then it is recorded as sent and the cursor moves up
        to it, never back."""
        if event_id <= self.floor or event_id in self.sent:
            return False
        self.sent.add(event_id)
        self.event = max(self.event, event_id)
        if len(self.sent) > _SENT_KEPT:
            kept = sorted(self.sent)[_SENT_KEPT // 2 :]
            self.floor, self.sent = kept[0] - 1, set(kept)
        return True

    @classmethod
    def parse(cls, raw: str | None) -> Cursor:
        m = _CURSOR.match(raw or "")
        return cls(int(m[1]), int(m[2])) if m else cls()

    def __str__(self) -> str:
        return f"m{self.metric}e{self.event}"


def frame(*, event: str, data: dict[str, Any], cursor: Cursor | str | None = None) -> str:
    head = f"id: {cursor}\n" if cursor is not None else ""
    return f"{head}event: {event}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n"


def event_frame(ev: dict[str, Any], cursor: Cursor) -> str:
    """A job_events row (as a dict) to an SSE frame: `status`, `log` or `event`."""
    kind = ev["kind"]
    if kind == "status":
        data = {"status": ev["message"], "error": (ev.get("data") or {}).get("error"), "time": ev["time"]}
    elif kind == "log":
        data = {"message": ev["message"], "time": ev["time"]}
    else:
        data = {"event": ev["message"], "data": ev.get("data"), "time": ev["time"]}
    return frame(event=kind if kind in ("status", "log") else "event", data=data, cursor=cursor)


def _replay(settings: Settings, job_id: int, cur: Cursor) -> tuple[list[str], bool, bool]:
    """Frames for rows after `cur` (advancing it), whether more remain, whether the job is over."""
    out: list[str] = []
    with session_for(settings.database_url) as s:
        terminal = get_job(s, job_id).status in TERMINAL
        events = events_after(s, job_id=job_id, after_id=cur.event, limit=_REPLAY_CHUNK)
        points = metrics_after(s, job_id=job_id, after_id=cur.metric, limit=_REPLAY_CHUNK)
        for p in points:
            cur.metric = p.id
            out.append(
                frame(
                    event="metric",
                    data={"step": p.step, "name": p.name, "value": p.value, "time": p.time},
                    cursor=cur,
                )
            )
        for ev in events:
            if not cur.takes_event(ev.id):
                continue
            row = {"kind": ev.kind, "message": ev.message, "data": ev.data, "time": ev.time}
            out.append(event_frame(row, cur))
    more = len(points) == _REPLAY_CHUNK or len(events) == _REPLAY_CHUNK
    return out, more, terminal


_Bodies = list[tuple[int, str]]
_Written = dict[tuple[int, int], tuple[list[str], int]]
_BODIES: dict[int, tuple[dict[str, Any], _Bodies, _Written]] = {}
"""id(message) -> (the message, its points' ids and `data:` JSON, the frames written for each
cursor seen). Every stream of a job gets the same decoded message object (api/live.py decodes
each payload once), so its points are encoded once per process, not once per open stream, and
the streams that stood at the same cursor (all those following live) share one list of frames;
the entry holds the message, so its id stays its own."""


def _metric_entry(msg: dict[str, Any]) -> tuple[_Bodies, _Written]:
    hit = _BODIES.get(id(msg))
    if hit is not None and hit[0] is msg:
        return hit[1], hit[2]
    keys = ("step", "name", "value", "time")
    bodies = [(p["id"], json.dumps({k: p[k] for k in keys}, separators=(",", ":"))) for p in msg["points"]]
    if len(_BODIES) >= 64:
        del _BODIES[next(iter(_BODIES))]
    _BODIES[id(msg)] = (msg, bodies, {})
    return bodies, _BODIES[id(msg)][2]


def _live_frames(msg: dict[str, Any], cur: Cursor) -> tuple[list[str], bool]:
    """Frames for one channel message not already replayed; True when it ends the job."""
    out: list[str] = []
    ended = False
    if msg.get("type") == "metrics":
        bodies, written = _metric_entry(msg)
        hit = written.get((cur.metric, cur.event))
        if hit is not None:
            out, cur.metric = hit
            return out, False  # (read-only, like the message)
        start = (cur.metric, cur.event)
        for point_id, body in bodies:
            if point_id > cur.metric:
                cur.metric = point_id
                out.append(f"id: {cur}\nevent: metric\ndata: {body}\n\n")  # as frame() writes it
        if len(written) < 8:
            written[start] = (out, cur.metric)
        return out, False
    elif msg.get("type") == "event" and cur.takes_event(msg["id"]):
        out.append(event_frame(msg, cur))
        ended = msg["kind"] == "status" and msg["message"] in TERMINAL
    return out, ended


async def _catch_up(settings: Settings, job_id: int, cur: Cursor) -> tuple[list[str], bool, bool]:
    """Everything after `cur` from the database: (frames, whether the job is over, whether the
    read went through). A read that failed (locked, restarting) leaves the rest to the next poll."""
    out: list[str] = []
    more = True
    try:
        while more:
            frames, more, terminal = await run_in_threadpool(_replay, settings, job_id, cur)
            out.extend(frames)
    except SQLAlchemyError as e:
        log.warning("stream of job %s: database read failed (%s); retrying", job_id, e)
        return out, False, False
    return out, terminal, True


async def job_events(settings: Settings, *, job_id: int, last_event_id: str | None) -> AsyncIterator[str]:
    cur = Cursor.parse(last_event_id)
    live = LiveChannel(settings.broker_url, job_channel(job_id))
    try:
        # subscribe before the replay, so nothing published in between is missed
        await live.connect()
        yield "retry: 2000\n\n"
        more = True
        while more:
            frames, more, terminal = await run_in_threadpool(_replay, settings, job_id, cur)
            if frames:
                yield "".join(frames)
        if terminal:
            return
        last_sent = last_check = time.monotonic()
        behind = False
        while True:
            msg = await live.next(timeout=1.0)
            now = time.monotonic()
            # a lost publish (the broker restarted, or is down: then poll every second) must not
            # stall the client: catch up from the database, at least once per keep-alive interval
            # (rarely: with many open streams these reads cost every other request latency).
            # After a gap (`resubscribed`: messages dropped or lost) that read comes before `msg`:
            # a newer message would move the cursor past the rows the gap held, and no replay
            # would send them; until a read goes through, live messages wait for the database
            if live.resubscribed:
                live.resubscribed, behind, last_check = False, True, float("-inf")
            recheck = min(_DB_RECHECK_S, settings.sse_keepalive_s) if live.up and not behind else 1.0
            if now - last_check > recheck:
                last_check = now
                frames, terminal, ok = await _catch_up(settings, job_id, cur)
                if frames:
                    yield "".join(frames)
                    last_sent = now
                if terminal:
                    return
                behind = behind and not ok
            if behind:
                msg = None  # its rows come with the next read of the database
            if msg is not None:
                frames, ended = _live_frames(msg, cur)
                if frames:
                    yield "".join(frames)  # one write for a message's frames, not one each
                    last_sent = now
                if ended:
                    return
            if now - last_sent > settings.sse_keepalive_s:
                last_sent = now
                yield ": keep-alive\n\n"
    finally:
        await live.close()
