"""The file of step costs a worker keeps per host for the fusion plan (trainer/selection/
step_costs.py measures and keys them; workers/step_costs.py keeps them): its format, and the checks
a line passes before anyone uses it.

The file: {"version": 1, "costs": {<key>: {"fixed_s": s, "member_s": s, "at": unix_s}}}, a key
being 64 hex digits. Lines come back from a group's trainer, which runs users' code and could have
forged them: `entry` accepts only finite numbers within bounds, `parse` at most MAX_ENTRIES of them
from at most MAX_BYTES. A forged line that passes can change only whether and how a batch fuses,
never what a trial computes (a fused member trains what it would alone, to 1e-5). A line older
than TTL_S is measured again: one measured while the machine was busy steers the plans of a day at
most.

The standard library only: the worker and the trainer both read these files.
"""

from __future__ import annotations

import json
import math
import re
import time
from pathlib import Path
from typing import Any

VERSION = 1
"""The file's and the keys' format; bumping it retires every kept line."""
TTL_S = 24 * 3600.0
"""A line is reused for this long after the worker took it, then measured again."""
MAX_ENTRIES = 256
"""Lines kept per file (the newest); a group's summary is read for at most MAX_REPORTED."""
MAX_REPORTED = 32
MAX_BYTES = 256 * 1024
"""A file larger than this is ignored whole (it was not written by `dump`)."""
MAX_STEP_S = 3600.0
"""The largest |fixed_s| or member_s taken: an hour a step is not a measurement."""
FUTURE_S = 300.0
"""A line stamped further ahead than this (a clock that jumped, a forgery) is ignored."""
KEY = re.compile(r"[0-9a-f]{64}")


def _number(x: Any, bound: float = MAX_STEP_S) -> float | None:
    """`x` as a float where it is a finite number within +-bound (not a bool, not a string)."""
    if isinstance(x, bool) or not isinstance(x, int | float):
        return None
    try:
        v = float(x)
    except OverflowError:  # an int past any float (JSON allows one)
        return None
    return v if math.isfinite(v) and abs(v) <= bound else None


def entry(raw: Any, *, now: float, stamped: bool = True) -> dict[str, float] | None:
    """`raw` as a kept line {"fixed_s", "member_s", "at"}, or None where anything is off: not a
    dict, a number that is not finite or out of bounds, a step that does not grow with its members
    or is not positive at one member, or (`stamped`) a stamp outside [now - TTL_S, now + FUTURE_S]."""
    if not isinstance(raw, dict):
        return None
    fixed, member = _number(raw.get("fixed_s")), _number(raw.get("member_s"))
    if fixed is None or member is None or member < 0 or not fixed + member > 0:
        return None
    out = {"fixed_s": fixed, "member_s": member}
    if stamped:
        at = _number(raw.get("at"), math.inf)
        if at is None or not now - TTL_S <= at <= now + FUTURE_S:
            return None
        out["at"] = at
    return out


def parse(doc: Any, *, now: float) -> dict[str, dict[str, float]]:
    """The valid lines of a file's document (any JSON value), the newest MAX_ENTRIES."""
    if not isinstance(doc, dict) or doc.get("version") != VERSION or not isinstance(doc.get("costs"), dict):
        return {}
    good = {
        k: e
        for k, raw in doc["costs"].items()
        if isinstance(k, str) and KEY.fullmatch(k) and (e := entry(raw, now=now)) is not None
    }
    return newest(good)


def newest(costs: dict[str, dict[str, float]]) -> dict[str, dict[str, float]]:
    keep = sorted(costs, key=lambda k: (-costs[k]["at"], k))[:MAX_ENTRIES]
    return {k: costs[k] for k in sorted(keep)}


def read(path: Path, *, now: float | None = None) -> dict[str, dict[str, float]]:
    """The valid lines of the file at `path`; a missing, unreadable, oversized or garbled file has
    none (this never raises for what the file holds)."""
    try:
        with path.open("rb") as f:
            data = f.read(MAX_BYTES + 1)
        if len(data) > MAX_BYTES:
            return {}
        doc = json.loads(data)
    except (OSError, ValueError, RecursionError):
        return {}
    return parse(doc, now=time.time() if now is None else now)


def dump(costs: dict[str, dict[str, float]]) -> str:
    return json.dumps({"version": VERSION, "costs": costs}, sort_keys=True)
