"""The trainer writes the stdout protocol (trainer/protocol.py, trainer/selection/__main__.py) and
the worker reads it (core/messages.py): the two sides agree, every line is numbered in order, and
nothing printed is lost."""

from __future__ import annotations

import io

from core.messages import parse_line
from trainer.protocol import JsonlSink
from trainer.selection.__main__ import Numbering, TrialLines


def test_job_lines_round_trip_numbered_in_order() -> None:
    buf = io.StringIO()
    sink = JsonlSink(buf)
    sink.metric(3, "loss", 2.5)
    sink.event("checkpoint", {"step": 3})
    sink.log("hello")
    sink.result({"steps": 3})
    msgs = [parse_line(line) for line in buf.getvalue().splitlines()]
    assert [m.seq for m in msgs] == [0, 1, 2, 3]
    assert [m.kind for m in msgs] == ["metric", "event", "log", "result"]
    assert (msgs[0].step, msgs[0].name, msgs[0].value) == (3, "loss", 2.5)
    assert (msgs[1].message, msgs[1].data) == ("checkpoint", {"step": 3})
    assert msgs[3].data == {"steps": 3} and all(m.trial is None for m in msgs)


def test_trial_lines_share_one_numbering_and_carry_the_trial() -> None:
    buf = io.StringIO()
    numbering = Numbering()
    a, b = TrialLines(buf, trial=0, numbering=numbering), TrialLines(buf, trial=1, numbering=numbering)
    a.metric(1, "val_loss", 1.0)
    b.event("trial", {"status": "succeeded", "steps_done": 1})
    a.result({"steps": 1})
    msgs = [parse_line(line) for line in buf.getvalue().splitlines()]
    assert [(m.seq, m.trial, m.kind) for m in msgs] == [(0, 0, "metric"), (1, 1, "event"), (2, 0, "result")]


def test_a_stray_line_is_a_log_line_and_a_blank_one_nothing() -> None:
    assert parse_line("   ") is None
    for raw in ("Traceback (most recent call last):", '{"kind": "nope"}', '{"kind": "metric", "step": "x"}'):
        msg = parse_line(raw)
        assert (msg.kind, msg.seq, msg.message) == ("log", None, raw)
