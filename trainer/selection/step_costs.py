"""Step costs measured once per host: the fusion plan's cost lines (trainer/selection/fusion_plan.py)
kept across a batch's groups and across batches, so an architecture already measured on this host
is planned without being measured again (a measurement costs a group 0.5-0.8 CPU-s on a CPU).

The file: {"version": 1, "costs": {<key>: {"fixed_s": s, "member_s": s, "at": unix_s}}}. A key
(`key`) is the SHA-256 of what a line depends on: the fields the members of a stack share
(trainer/selection/fused.py MATCH_FIELDS: the model, the data shape, the batch size, the
optimizer), the stack size the line was fitted at, the device kind (a GPU's name), the batch's
device count, torch's thread count and version, and the measuring rules. Another architecture,
another stack size or another thread count is another key, so a line is never reused for what it
did not measure.

Who writes it: never the trainer. The worker keeps each host's file outside the sandbox
(workers/step_costs.py), hands a group's trainer a copy in the group's folder (`--step-costs`),
and takes the lines the trainer measured from its summary (`fusion.measured`), which users' code
in the trainer could have forged: `entry` accepts only finite numbers within bounds, `parse` at
most MAX_ENTRIES of them from at most MAX_BYTES. A forged line that passes can change only whether
and how a batch fuses, never what a trial computes (a fused member trains what it would alone, to
1e-5). A line older than TTL_S is measured again: one measured while the machine was busy steers
the plans of a day at most.

This module imports no torch at import time (the worker reads these files).
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from jobrules.spec import JobSpec
    from trainer.selection.fusion_plan import StepCost

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


def key(job: JobSpec, *, size: int, devices: Sequence[torch.device]) -> str:
    """The key of `job`'s architecture's line fitted at `size` members on `devices` (see the
    module docstring for what it holds)."""
    import torch

    from trainer.selection.fused import MATCH_FIELDS
    from trainer.selection.fusion_plan import MEASURE_MAX, MEASURE_STEPS, MIN_GAIN

    arch = []
    for section, name in MATCH_FIELDS:
        fields = getattr(job, section).model_dump(mode="json")
        arch.append([section, fields if not name else {name: fields[name]}])
    dev = devices[0]
    what = {
        "version": VERSION,
        "arch": arch,
        "size": size,
        "device": dev.type,
        "gpu": torch.cuda.get_device_name(dev) if dev.type == "cuda" else None,
        "devices": len(devices),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "rules": [MEASURE_STEPS, MEASURE_MAX, MIN_GAIN],
    }
    return hashlib.sha256(json.dumps(what, sort_keys=True, default=str).encode()).hexdigest()


class Book:
    """The trainer's view of the host's lines: `get` an architecture's line where one is kept,
    `add` what was measured (reported in the summary as `measured`, for the worker to keep)."""

    def __init__(self, known: dict[str, dict[str, float]] | None = None) -> None:
        self.known = dict(known or {})
        self.measured: list[dict[str, Any]] = []
        """The lines measured by this run: {"key", "fixed_s", "member_s"}, in order."""
        self.reused = 0
        """Architectures planned from a kept line."""
        self._lock = threading.Lock()  # the batch's devices measure at once

    @classmethod
    def load(cls, path: Path | None) -> Book:
        return cls(read(path) if path is not None else None)

    def get(self, jobs: Sequence[JobSpec], devices: Sequence[torch.device]) -> StepCost | None:
        """The kept line of `jobs`' architecture that `measure` would fit for them: the one fitted
        at their stack size (min(len(jobs), MEASURE_MAX), 1 for a lone trial), else the one fitted
        at two members where it leaves a stack nothing to share (`measure` stops there then)."""
        from trainer.selection.fusion_plan import MEASURE_MAX, MIN_GAIN, StepCost

        size = min(len(jobs), MEASURE_MAX)
        for k in dict.fromkeys((size, 2)):
            with self._lock:
                e = self.known.get(key(jobs[0], size=k, devices=devices))
            if e is None:
                continue
            try:
                cost = StepCost(fixed_s=e["fixed_s"], member_s=e["member_s"])
            except (KeyError, TypeError, ValueError):
                continue
            if k == size or size == 1 or cost.fixed_s < MIN_GAIN * cost.step_s(1):
                with self._lock:
                    self.reused += 1
                return cost
        return None

    def add(self, job: JobSpec, *, size: int, devices: Sequence[torch.device], cost: StepCost) -> None:
        k = key(job, size=size, devices=devices)
        line = {"fixed_s": cost.fixed_s, "member_s": cost.member_s}
        with self._lock:
            self.known[k] = {**line, "at": time.time()}
            self.measured.append({"key": k, **line})
