"""Server-Sent Events for one job: replay what the client missed from the database, then relay the
job's Redis channel live.

The event id is a cursor over both tables, `m<last metric id>e<last event id>`, so a client that
reconnects with Last-Event-ID gets exactly the points and events it has not seen. The worker
writes rows first and publishes their ids after, so everything on the channel is also in the
database: we subscribe *before* replaying and drop channel messages the replay already covered.

A job's events have several writers (the worker's relay, the API's cancel, the scheduler's logs),
each publishing after its own commit, so their ids can reach the channel out of order (the cancel's
101 before the relay's 100), and on PostgreSQL they can also commit out of order (an id is drawn
before its commit), so a read of the database can see 101 while 100 is not there yet. So the cursor
keeps, beside the highest id sent, the ids this stream has sent (`Cursor.sent`: an event below the
cursor that was not sent still goes out, a duplicate does not), and a horizon: the highest id sent
more than `_SETTLE_S` ago, below which every event has arrived. Reads of the database start at the
horizon, not at the highest id, and the SSE id carries the horizon plus the few ids sent above it
(`m<metric>e<horizon>s<id>.<id>`), so a client that reconnects inside the window gets the lower id
it had not seen, and not again the ones it had. What remains: an event published more than
`_SETTLE_S` after a higher one that this stream has sent, and not yet sent when the client
reconnects, is not replayed. And the stream of a finished job always sends the job's final status,
even when the client had it already, so a client never waits for a status that passed it.

What the stream shows comes from the database, or from a channel message the service signed
(api/live.py verifies it; an unverified one never gets here). A job's end is the database's word
alone: a terminal status on the channel only makes the stream read the database at once, and the
stream sends the final status and closes when that read says the job is over. Without a signing
key every message is a `Wake` and the stream reads the database on it (at most every
`_WAKE_READ_S`).

A stream holds no database connection while it waits: each read is its own short session, in the
streams' own thread limiter (api/stream_threads.py), so a request never waits behind them. When the
broker goes away the stream polls the database instead and subscribes again once it is back, so a
redis-server restart costs the client latency, never a point.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import re
import time
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy.exc import SQLAlchemyError

from api.live import LiveChannel, Wake
from api.stream_threads import in_stream_thread
from core.broker import broker_signing_key, job_channel
from core.settings import Settings
from core.telemetry import SSE_READS, SSE_ROWS
from db.connection import session_for
from db.ingest import events_after, last_status_event, metrics_after, newest_event_id, newest_metric_id
from db.jobs import job_status
from db.models import TERMINAL, JobEvent

log = logging.getLogger(__name__)
_CURSOR = re.compile(r"^m(\d+)e(\d+)(?:s(\d+(?:\.\d+)*))?$")
_REPLAY_CHUNK = 5000
_DB_RECHECK_S = 15.0
_WAKE_READ_S = 0.25
"""The shortest time between two reads a stream makes on wake-ups (unverified messages): a burst of
them, or a flood someone publishes, costs each stream at most four reads a second."""


_SENT_KEPT = 4096
_SETTLE_S = 5.0
"""How long after a higher event id a lower one may still arrive (a writer's commit-to-publish time,
or on PostgreSQL its draw-to-commit time): until then the cursor's horizon stays below it."""
_RECENT_KEPT = 8
"""Ids sent above the horizon that the SSE id carries, at most (older ones move the horizon up)."""
MAX_CURSOR = 256
"""The longest SSE id (Last-Event-ID) a stream writes or reads: 10 ids of 19 digits and their marks."""


@dataclass(slots=True)
class Cursor:
    metric: int = 0
    sent: set[int] = field(default_factory=set, compare=False, repr=False)
    """Event ids this stream has sent (the newest _SENT_KEPT); below `floor` counts as sent."""
    floor: int = 0
    horizon: int = 0
    """Every event of the job up to here has been sent (or counts as sent): reads start above it."""
    recent: deque[tuple[float, int]] = field(default_factory=deque, compare=False, repr=False)
    """(when, id) of the ids sent above the horizon, oldest first."""
    _token: str | None = field(default=None, compare=False, repr=False)
    final: bool = field(default=False, compare=False, repr=False)
    """The last status this stream sent is a terminal one (a new stream, one that reconnects,
    starts without: it sends the final status whether or not its client had it)."""

    def takes_event(self, event_id: int, *, now: float | None = None) -> bool:
        """Whether an event is new to this stream: above the cursor, or below it but not sent yet
        (another writer's, published late); then it is recorded as sent and the cursor moves up
        to it, never back."""
        if event_id <= self.floor or event_id in self.sent:
            return False
        self.sent.add(event_id)
        if len(self.sent) > _SENT_KEPT:
            kept = sorted(self.sent)[_SENT_KEPT // 2 :]
            self.floor, self.sent = kept[0] - 1, set(kept)
        if event_id > self.horizon:
            self.recent.append((time.monotonic() if now is None else now, event_id))
            self._token = None
            self.settle(now)
        return True

    def settle(self, now: float | None = None) -> None:
        """Move the horizon up past the ids sent more than _SETTLE_S ago (or beyond _RECENT_KEPT)."""
        now = time.monotonic() if now is None else now
        while self.recent and (now - self.recent[0][0] > _SETTLE_S or len(self.recent) > _RECENT_KEPT):
            self.horizon = max(self.horizon, self.recent.popleft()[1])
            self._token = None

    @classmethod
    def parse(cls, raw: str | None) -> Cursor:
        m = _CURSOR.match(raw or "") if len(raw or "") <= MAX_CURSOR else None
        if not m:
            return cls()
        horizon = int(m[2])
        above = sorted({int(i) for i in m[3].split(".") if int(i) > horizon} if m[3] else set())
        above = above[-_RECENT_KEPT:]
        now = time.monotonic()
        return cls(
            metric=int(m[1]),
            sent=set(above),
            floor=horizon,
            horizon=horizon,
            recent=deque((now, i) for i in above),
        )

    @property
    def event(self) -> int:
        """The highest event id sent (the newest are always among those kept)."""
        return max(self.horizon, max(self.sent, default=0))

    @property
    def token(self) -> str:
        """The event part of the SSE id (what frames written at this cursor share)."""
        if self._token is None:
            above = sorted(i for _, i in self.recent if i > self.horizon)
            self._token = f"e{self.horizon}" + ("s" + ".".join(map(str, above)) if above else "")
        return self._token

    def __str__(self) -> str:
        return f"m{self.metric}{self.token}"


def frame(*, event: str, data: dict[str, Any], cursor: Cursor | str | None = None) -> str:
    head = f"id: {cursor}\n" if cursor is not None else ""
    return f"{head}event: {event}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n"


def event_frame(ev: dict[str, Any], cursor: Cursor) -> str:
    """A job_events row (as a dict) to an SSE frame: `status`, `log` or `event`. A status frame
    also records on the cursor whether it is final (the stream's last status)."""
    kind = ev["kind"]
    if kind == "status":
        cursor.final = ev["message"] in TERMINAL
        data = {"status": ev["message"], "error": (ev.get("data") or {}).get("error"), "time": ev["time"]}
    elif kind == "log":
        extra = ev.get("data") or {}
        # the trainer's own output names its rank and stream (stdout, stderr); its status lines do not
        data = {
            "message": ev["message"],
            "time": ev["time"],
            "rank": extra.get("rank"),
            "stream": extra.get("stream"),
        }
    else:
        data = {"event": ev["message"], "data": ev.get("data"), "time": ev["time"]}
    return frame(event=kind if kind in ("status", "log") else "event", data=data, cursor=cursor)


@dataclass(slots=True)
class _Read:
    frames: list[str]
    more: bool
    """A chunk came back full: read again from `after`."""
    terminal: bool
    """The job is over (read before its events, so its final status is among them)."""
    after: int
    """The last event id read."""


def _replay(
    settings: Settings,
    job_id: int,
    cur: Cursor,
    *,
    after: int | None = None,
    upto: int | None = None,
) -> _Read:
    """Frames for the rows after `cur` (advancing it): metric points after its metric id (up to
    `upto`, unless the job is over), events after its horizon (or `after`, the last id a previous
    chunk read) that it has not sent."""
    out: list[str] = []
    cur.settle()
    after = cur.horizon if after is None else after
    with session_for(settings.database_url) as s:
        terminal = job_status(s, job_id) in TERMINAL
        events = events_after(s, job_id=job_id, after_id=after, limit=_REPLAY_CHUNK)
        # a finished job's stream ends with this read: every point goes, whatever the bound
        bound = None if terminal else upto
        points = metrics_after(s, job_id=job_id, after_id=cur.metric, upto_id=bound, limit=_REPLAY_CHUNK)
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
            after = ev.id
            if not cur.takes_event(ev.id):
                continue
            out.append(event_frame(_row(ev), cur))
    more = len(points) == _REPLAY_CHUNK or len(events) == _REPLAY_CHUNK
    return _Read(frames=out, more=more, terminal=terminal, after=after)


def _final_status(settings: Settings, job_id: int, cur: Cursor) -> list[str]:
    """The finished job's last status event, sent again: its stream sends it whether or not
    the client saw it before (a client waiting for it must not wait for ever)."""
    with session_for(settings.database_url) as s:
        ev = last_status_event(s, job_id=job_id)
        if ev is None or ev.message not in TERMINAL:
            return []
        return [event_frame(_row(ev), cur)]


def _row(ev: JobEvent) -> dict[str, Any]:
    return {"kind": ev.kind, "message": ev.message, "data": ev.data, "time": ev.time}


_Bodies = list[tuple[int, str]]
_Written = dict[tuple[int, str], tuple[str, int]]
_BODIES: dict[int, tuple[dict[str, Any], _Bodies, _Written]] = {}
"""id(message) -> (the message, its points' ids and `data:` JSON, the text written for each cursor
seen). Every stream of a job gets the same decoded message object (api/live.py decodes each
payload once), so its points are encoded once per process, not once per open stream, and the
streams that stood at the same cursor (all those following live) share one string of frames;
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


def _live_frames(msg: dict[str, Any], cur: Cursor) -> tuple[str, bool]:
    """The frames, as one string (one write), for one (verified) channel message not already
    replayed; True when the message says the job ended: the caller reads the database now, and
    the final status goes out from there once the database says so."""
    out: list[str] = []
    ended = False
    if msg.get("type") == "metrics":
        bodies, written = _metric_entry(msg)
        cur.settle()
        hit = written.get((cur.metric, cur.token))
        if hit is not None:
            text, cur.metric = hit
            return text, False
        start = (cur.metric, cur.token)
        for point_id, body in bodies:
            if point_id > cur.metric:
                cur.metric = point_id
                out.append(f"id: {cur}\nevent: metric\ndata: {body}\n\n")  # as frame() writes it
        text = "".join(out)
        if len(written) < 8:
            written[start] = (text, cur.metric)
        return text, False
    elif msg.get("type") == "live_log":
        # output past the job's stored head (workers/logcap.py): live only, so no id to resume by
        data = {k: msg.get(k) for k in ("message", "time", "rank", "stream")}
        out.append(frame(event="log", data=data))
    elif msg.get("type") == "event":
        if msg.get("kind") == "status" and msg.get("message") in TERMINAL:
            # not taken: the database read it brings sends this event, and ends the stream, once
            # the job's row agrees (a message is a claim; the row is the job's state)
            ended = True
        elif cur.takes_event(msg["id"]):
            out.append(event_frame(msg, cur))
    return "".join(out), ended


@dataclass(frozen=True, slots=True)
class _Look:
    """A job's state as one read of the database saw it, shared by every stream of the job in this
    process whose periodic recheck falls due while it is fresh."""

    at: float
    """When the read began (monotonic)."""
    terminal: bool
    newest_metric: int
    newest_event: int


_LOOKS: dict[tuple[str, int], _Look] = {}
_LOOKING: dict[tuple[str, int], tuple[float, asyncio.Future[_Look]]] = {}
"""Reads under way (when each began), of this process's event loop: one left by a loop that
closed is never awaited from another."""
_LOOKS_KEPT = 4096


def _read_look(settings: Settings, job_id: int) -> _Look:
    at = time.monotonic()
    with session_for(settings.database_url) as s:
        terminal = job_status(s, job_id) in TERMINAL
        return _Look(
            at=at,
            terminal=terminal,
            newest_metric=newest_metric_id(s, job_id=job_id),
            newest_event=newest_event_id(s, job_id=job_id),
        )


async def _look(settings: Settings, job_id: int, *, since: float) -> _Look:
    """The job's state read at `since` or later: one read of the database (three index lookups)
    for all of the job's streams whose rechecks fall due meanwhile, each stream reading rows of its
    own only when that read shows some it may lack. 500 streams over 10 jobs made 33 reads of four
    queries a second; they make about one a second now. Raises what the read raised."""
    key = (settings.database_url, job_id)
    hit = _LOOKS.get(key)
    if hit is not None and hit.at >= since:
        return hit
    pending = _LOOKING.get(key)
    if pending is not None and pending[1].get_loop() is not asyncio.get_running_loop():
        pending = None
    if pending is None or pending[0] < since:
        began = time.monotonic()
        SSE_READS.labels("look").inc()
        task = asyncio.ensure_future(in_stream_thread(_read_look, settings, job_id))
        pending = (began, task)
        _LOOKING[key] = pending

        def done(t: asyncio.Future[_Look], key: tuple[str, int] = key, began: float = began) -> None:
            if _LOOKING.get(key, (None,))[0] == began:
                del _LOOKING[key]
            if not t.cancelled() and t.exception() is None:
                look = t.result()
                old = _LOOKS.get(key)
                if old is None or old.at < look.at:
                    if len(_LOOKS) >= _LOOKS_KEPT:
                        del _LOOKS[next(iter(_LOOKS))]
                    _LOOKS[key] = look

        task.add_done_callback(done)
    # shielded: a stream that closes while it waits does not cancel the others' read
    return await asyncio.shield(pending[1])


@dataclass(slots=True)
class _Reads:
    """What one read of the database (all its chunks) gave a stream, beside its frames."""

    why: str
    """`open`, `catch_up` or `recheck` (the streams' read counters, core/telemetry.py)."""
    upto: int | None = None
    """Read metric points up to this id only (a recheck: see job_events)."""
    terminal: bool = False
    newest: int = 0
    """The job's newest metric id, read by a recheck."""


async def _reads(settings: Settings, job_id: int, cur: Cursor, how: _Reads) -> AsyncIterator[list[str]]:
    """Everything after `cur` from the database, a chunk at a time (`how.terminal`: whether the
    job is over). A finished job's last chunk ends with its final status if this stream has not
    sent it.
    The reads run under the streams' own thread limiter (api/stream_threads.py), not the requests'."""
    after: int | None = None
    SSE_READS.labels(how.why).inc()
    while True:
        read = await in_stream_thread(
            _replay,
            settings,
            job_id,
            cur,
            after=after,
            upto=how.upto,
        )
        frames = read.frames
        if not read.more and read.terminal and not cur.final:
            frames = frames + await in_stream_thread(_final_status, settings, job_id, cur)
        if frames:
            SSE_ROWS.labels(how.why).inc(len(frames))
        how.terminal = read.terminal
        yield frames
        if not read.more:
            return
        after = read.after


async def _catch_up(settings: Settings, job_id: int, cur: Cursor, how: _Reads) -> tuple[list[str], bool]:
    """Everything after `cur` from the database: (frames, whether the read went through); `how`
    gets whether the job is over. A read that failed (locked, restarting) leaves the rest to the
    next poll."""
    out: list[str] = []
    try:
        async for frames in _reads(settings, job_id, cur, how):
            out.extend(frames)
    except SQLAlchemyError as e:
        log.warning("stream of job %s: database read failed (%s); retrying", job_id, e)
        how.terminal = False
        return out, False
    return out, True


async def _recheck(
    settings: Settings, job_id: int, cur: Cursor, how: _Reads, *, since: float
) -> tuple[list[str], bool]:
    """A following stream's periodic look: the job's shared state (`_look`, read at `since` or
    later), then rows of its own only when the job is over, a point up to `how.upto` has not come
    live, or the job has an event above the cursor's horizon. `how.newest` gets the newest metric
    id the look saw. Half an interval's age keeps each look newer than the
    stream's previous one."""
    try:
        look = await _look(settings, job_id, since=since)
    except SQLAlchemyError as e:
        log.warning("stream of job %s: database read failed (%s); retrying", job_id, e)
        return [], False
    cur.settle()
    upto = cur.metric if how.upto is None else how.upto
    how.newest = look.newest_metric
    # while the stream has sent events above its horizon (the last `_SETTLE_S`), a lower one of
    # another writer may still commit; the look, up to half an interval old, may predate it
    # with nothing sent above its horizon in that window, any event above it is one not sent
    if not look.terminal and upto <= cur.metric and not cur.recent and look.newest_event <= cur.horizon:
        return [], True
    return await _catch_up(settings, job_id, cur, how)


async def job_events(settings: Settings, *, job_id: int, last_event_id: str | None) -> AsyncIterator[str]:
    cur = Cursor.parse(last_event_id)
    live = LiveChannel(settings.broker_url, job_channel(job_id), signing_key=broker_signing_key(settings))
    try:
        # subscribe before the replay, so nothing published in between is missed
        await live.connect()
        yield "retry: 2000\n\n"
        opened = _Reads("open")
        async for frames in _reads(settings, job_id, cur, opened):
            if frames:
                yield "".join(frames)
        if opened.terminal:
            return
        # the newest metric id the stream knows to be in the database and published (or lost)
        # by its next recheck: the replay's last point
        mark = cur.metric
        last_sent = time.monotonic()
        # each stream's periodic read of the database keeps a phase of its own: streams opened
        # together (a page many people watch, reconnects after an API restart) read at the same
        # moment otherwise, and 50 such reads at once held every request of the process for 0.4-1.6
        # s every 15 s (bench/api_load.py: the slowest requests all started 16-18 s into a run)
        last_check = last_sent - random.uniform(0.0, min(_DB_RECHECK_S, settings.sse_keepalive_s))
        behind = False
        # when a wake-up (or a terminal status on the channel) has the database read next
        wake_at: float | None = None
        while True:
            wait = 1.0 if wake_at is None else min(1.0, max(0.0, wake_at - time.monotonic()))
            msg = await live.next(timeout=wait)
            now = time.monotonic()
            if isinstance(msg, Wake):
                msg = None  # unverified: it says nothing but "look"
                if wake_at is None:
                    wake_at = max(now, last_check + _WAKE_READ_S)
            # a lost publish (the broker restarted, or is down: then poll every second) must not
            # stall the client: catch up from the database, at least once per keep-alive interval
            # (rarely: with many open streams these reads cost every other request latency).
            # After a gap (`resubscribed`: messages dropped or lost) that read comes before `msg`:
            # a newer message would move the cursor past the rows the gap held, and no replay
            # would send them; until a read goes through, live messages wait for the database
            if live.resubscribed:
                live.resubscribed, behind, last_check = False, True, float("-inf")
            recheck = min(_DB_RECHECK_S, settings.sse_keepalive_s) if live.up and not behind else 1.0
            if now - last_check > recheck or (wake_at is not None and now >= wake_at):
                # a periodic read keeps the stream's phase: one at `now` would gather every stream
                # whose read fell due while the process was held up (a slow request, a busy
                # machine) at the same moment, and they would read together from then on
                periodic = wake_at is None and now - last_check < 2 * recheck
                last_check = last_check + recheck if periodic else now
                # Following live, a recheck reads points only up to the newest id the previous
                # recheck saw (`mark`): those were committed and published at least one interval
                # ago, so the live path has sent them unless their publish was lost. Points
                # newer than that are on their way on the channel; read here, each stream would
                # frame again, from the database, what every stream gets live a moment later
                # (bench/api_load.py: a fifth of the API's CPU with a fast job). A lost publish
                # is sent one to two intervals late instead of up to one.
                # a wake-up reads everything there is (its rows are what it announced)
                following = live.up and not behind and wake_at is None
                how = _Reads("recheck", upto=mark) if following else _Reads("catch_up")
                if following:
                    frames, ok = await _recheck(settings, job_id, cur, how, since=now - recheck / 2)
                else:
                    frames, ok = await _catch_up(settings, job_id, cur, how)
                if frames:
                    yield "".join(frames)
                    last_sent = now
                if how.terminal:
                    return
                behind = behind and not ok
                if ok:
                    mark = how.newest if following else cur.metric
                    wake_at = None
                elif wake_at is not None:
                    wake_at = now + 1.0  # the database is busy: ask it again in a second, not at once
            if behind:
                msg = None  # its rows come with the next read of the database
            if msg is not None:
                text, ended = _live_frames(msg, cur)
                if text:
                    yield text  # one write for a message's frames, not one each
                    last_sent = now
                if ended and wake_at is None:
                    wake_at = now  # the job may be over: the database says, at once
            if now - last_sent > settings.sse_keepalive_s:
                last_sent = now
                yield ": keep-alive\n\n"
    finally:
        await live.close()
