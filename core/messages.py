"""The reading side of the trainer's stdout protocol (trainer/protocol.py writes it; the trainer
imports nothing of ours, so the format is stated on both sides and tested across them).

One JSON object per line. Every line carries `seq`, a number that grows by one per line within
one trainer process (the worker applies a line at most once per attempt by it); lines of a
selection group carry `trial`, the trial's index (null on the group's own lines):

    {"seq": 7, "kind": "metric", "step": 12, "name": "loss", "value": 3.91, "time": 1732.1}
    {"seq": 8, "kind": "log", "message": "...", "time": ...}
    {"seq": 9, "kind": "event", "event": "checkpoint", "data": {"step": 12, ...}, "time": ...}
    {"seq": 10, "kind": "result", "data": {...}, "time": ...}
    {"seq": 11, "kind": "error", "message": "...", "time": ...}
    {"seq": 12, "trial": null, "kind": "batch_result", "data": {...}, "time": ...}

A line that is not such an object is kept as a log line (a stray print) with no number.

The other way, a worker hands a selection group to `python -m trainer.selection` as a
SelectionBatch (its trials and the request's ranking rules): defined once in jobrules/spec.py, where
the trainer (which imports nothing of ours but jobrules) reads it with the same model.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field
from typing import Any

from jobrules.spec import BatchTrial, SelectionBatch

__all__ = ["KINDS", "BatchTrial", "Message", "SelectionBatch", "parse_line"]

KINDS = frozenset({"metric", "log", "event", "result", "error", "batch_result"})


@dataclass(slots=True)
class Message:
    kind: str
    """metric | log | event | result | error | batch_result"""
    seq: int | None = None
    trial: int | None = None
    time: float = field(default_factory=time.time)
    step: int = 0
    name: str = ""
    value: float = 0.0
    message: str = ""
    """log and error lines; the event's name for event lines"""
    data: dict[str, Any] = field(default_factory=dict)


def finite(obj: Any) -> Any:
    """`obj` with every NaN or infinite float inside it made None: JSON has no such numbers, and
    PostgreSQL refuses a json value holding one (a run stopped before its first step reports a
    NaN final loss), so a result or an event's data would never be stored."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: finite(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [finite(v) for v in obj]
    return obj


def parse_line(line: str) -> Message | None:
    """One stdout line -> a Message (None for a blank line). Never raises: a malformed line is a
    log line, so nothing the trainer prints is lost."""
    text = line.strip()
    if not text:
        return None
    try:
        obj = json.loads(text)
        kind = obj["kind"]
        if kind not in KINDS:
            raise ValueError(kind)
        seq = obj.get("seq")
        trial = obj.get("trial")
        msg = Message(
            kind=kind,
            seq=int(seq) if seq is not None else None,
            trial=int(trial) if trial is not None else None,
            time=float(obj.get("time") or time.time()),
        )
        if kind == "metric":
            msg.step, msg.name, msg.value = int(obj["step"]), str(obj["name"]), float(obj["value"])
        elif kind in ("log", "error"):
            msg.message = str(obj.get("message", ""))
        elif kind == "event":
            msg.message = str(obj.get("event", ""))
            msg.data = finite(dict(obj.get("data") or {}))
        else:
            msg.data = finite(dict(obj.get("data") or {}))
        return msg
    except (ValueError, KeyError, TypeError, AttributeError):
        return Message(kind="log", message=text[:2000])
