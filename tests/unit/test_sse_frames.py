"""The live path of a job's stream: the frames written from one shared, once-decoded channel
message are exactly what frame() writes for each point, per stream cursor."""

from __future__ import annotations

import json
from typing import Any

from api.live import _decode
from api.sse import Cursor, _live_frames, frame


def _payload(points: list[tuple[int, int, float]]) -> bytes:
    pts = [{"id": i, "step": s, "name": "train_loss", "value": v, "time": 1.5 + s} for i, s, v in points]
    return json.dumps({"type": "metrics", "points": pts}).encode()


def test_streams_share_one_decoded_message_and_write_frame_text() -> None:
    raw = _payload([(7, 1, 2.5), (8, 2, float("nan")), (9, 3, -0.0)])
    # two streams get equal bytes (separate objects, as from two subscriptions)
    a, b = _decode(raw), _decode(bytes(bytearray(raw)))
    assert a is b

    behind, ahead = Cursor.parse("m0e4"), Cursor.parse("m8e4")
    frames_behind, ended = _live_frames(a, behind)
    frames_ahead, _ = _live_frames(b, ahead)
    assert not ended
    expected = []
    cur = Cursor.parse("m0e4")
    for p in json.loads(raw)["points"]:
        cur.metric = p["id"]
        data = {k: p[k] for k in ("step", "name", "value", "time")}
        expected.append(frame(event="metric", data=data, cursor=cur))
    assert frames_behind == "".join(expected)  # one string: one write for the message
    assert 'data: {"step":3,"name":"train_loss","value":-0.0' in expected[2]
    assert "NaN" in expected[1]
    # a stream already past point 8 gets only point 9, with its own cursor in the id
    assert frames_ahead == expected[2]
    assert (behind.metric, ahead.metric) == (9, 9)


def test_a_changed_message_is_encoded_afresh() -> None:
    first = _live_frames(_decode(_payload([(20, 5, 1.0)])), Cursor())[0]
    second = _live_frames(_decode(_payload([(20, 5, 2.0)])), Cursor())[0]
    assert '"value":1.0' in first and '"value":2.0' in second


def test_a_terminal_status_on_the_channel_only_asks_the_database() -> None:
    """The job's end is the database's word: a terminal status on the channel (even a signed one)
    writes nothing itself and leaves the event unsent, so the read it asks for sends it, once the
    job's row says the job is over."""
    msg = _decode(
        json.dumps({"type": "event", "id": 3, "kind": "status", "message": "succeeded", "time": 1.0}).encode()
    )
    cur = Cursor.parse("m0e2")
    frames, ended = _live_frames(msg, cur)
    assert ended and frames == ""
    assert cur.takes_event(3)  # still new to the stream: the database read sends it
    running = {"type": "event", "id": 4, "kind": "status", "message": "running", "time": 1.0}
    frames, ended = _live_frames(running, Cursor.parse("m0e2"))
    # the id keeps the horizon (2) and lists 4 above it, until 4 has settled
    assert not ended and frames.startswith("id: m0e2s4\nevent: status\n")


def test_the_horizon_settles_and_a_reconnect_gets_the_late_lower_id_once() -> None:
    cur = Cursor.parse("m5e90")
    assert cur.takes_event(101, now=0.0) and str(cur) == "m5e90s101"
    assert cur.takes_event(100, now=1.0) and str(cur) == "m5e90s100.101"  # late, below the cursor
    assert not cur.takes_event(101, now=1.5)  # published twice
    again = Cursor.parse(str(cur))  # a client reconnecting with that id
    assert (again.horizon, again.event, again.sent) == (90, 101, {100, 101})
    assert not again.takes_event(100) and not again.takes_event(101) and again.takes_event(99 + 4)
    # sent long enough ago, they are below the horizon: the id is short again
    cur.settle(now=1.0 + 5.01)
    assert str(cur) == "m5e101" and cur.horizon == 101
    # an id that is not a cursor, or ids at or below the horizon, are taken for what they say
    assert Cursor.parse("garbage") == Cursor() and Cursor.parse("m1e9s3.9").sent == set()


def test_the_id_lists_at_most_a_few_ids_above_the_horizon() -> None:
    cur = Cursor()
    for i in range(1, 21):
        assert cur.takes_event(i, now=0.0)
    assert str(cur) == "m0e12s" + ".".join(str(i) for i in range(13, 21))
    assert Cursor.parse("m0e0s" + ".".join(str(i) for i in range(1, 40))).sent == set(range(32, 40))


def test_streams_at_one_cursor_share_the_frames_and_advance_alike() -> None:
    msg = _decode(_payload([(30, 7, 1.0), (31, 8, 2.0)]))
    first, second, behind = Cursor.parse("m29e2"), Cursor.parse("m29e2"), Cursor.parse("m0e2")
    a, _ = _live_frames(msg, first)
    b, _ = _live_frames(msg, second)
    assert a is b and (first.metric, second.metric) == (31, 31)  # one string, joined once
    assert a.startswith("id: m30e2\n") and "\n\nid: m31e2\n" in a
    # another cursor (another event id in it) writes its own ids
    c, _ = _live_frames(msg, Cursor.parse("m29e5"))
    assert c.startswith("id: m30e5\n")
    assert _live_frames(msg, behind)[0] == a and behind.metric == 31
    # a stream already past the message gets nothing, and its cursor stays
    done = Cursor.parse("m31e2")
    assert _live_frames(msg, done) == ("", False) and done.metric == 31


def test_a_live_log_line_goes_out_without_an_id() -> None:
    """Output past a job's stored head is published live only (workers/logcap.py): its frame has
    no id, so a client resuming by Last-Event-ID keeps its place in the stored rows."""
    cur = Cursor.parse("m3e4")
    msg = {"type": "live_log", "message": "epoch 9", "time": 1.5, "rank": 1, "stream": "stdout"}
    frames, ended = _live_frames(msg, cur)
    assert not ended and frames == (
        'event: log\ndata: {"message":"epoch 9","time":1.5,"rank":1,"stream":"stdout"}\n\n'
    )
    assert str(cur) == "m3e4"


def test_a_jobs_frames_are_built_once_for_all_its_streams(monkeypatch: Any) -> None:
    """500 streams over 10 jobs: each job's message is encoded once, whatever the number of its
    streams, and the streams that follow live (one cursor) share one string of frames."""
    import api.sse as sse

    encoded: list[object] = []
    real = sse.json.dumps

    def counting(obj: object, **kw: Any) -> str:
        encoded.append(obj)
        return real(obj, **kw)

    msgs = [_decode(_payload([(100 * job + 1, 1, 0.5), (100 * job + 2, 2, 0.25)])) for job in range(10)]
    monkeypatch.setattr(sse.json, "dumps", counting)
    texts: dict[int, set[int]] = {}
    for job, msg in enumerate(msgs):
        for _ in range(50):
            text, _ = _live_frames(msg, Cursor.parse(f"m{100 * job}e0"))
            texts.setdefault(job, set()).add(id(text))
    assert len(encoded) == 10 * 2  # each job's two points, once: not once per stream
    assert all(len(ids) == 1 for ids in texts.values())  # one string per job for its 50 streams
