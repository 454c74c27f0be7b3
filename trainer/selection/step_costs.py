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
and takes the lines the trainer measured from its summary (`fusion.measured`), checked as
jobrules/step_costs.py says (the file's format and its checks live there).

This module imports no torch at import time (the worker reads these files).
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from jobrules.step_costs import VERSION, read

if TYPE_CHECKING:
    import torch

    from jobrules.spec import JobSpec
    from trainer.selection.fusion_plan import StepCost


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
