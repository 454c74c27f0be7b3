"""A user's own metrics: `report(name, value)` from a workspace's model or data code.

    from trainer.report import evaluating, report

    class MyModel(ModelRecipe):
        def loss(self, outputs, targets):
            report("val_accuracy" if evaluating() else "accuracy",
                   (outputs.argmax(-1) == targets).float().mean())
            return F.cross_entropy(outputs, targets)

The value is recorded at the step being trained: each name once per step, the mean of the values
reported during that step (its micro-batches, its validation batches). At a step that evaluates,
a name reported during the evaluation records the mean over the validation batches, whatever the
training half of the step reported under it. Outside training (the trainer's shape check on the
meta device, a script of one's own) `report` does nothing and reads nothing, so a recipe may call
it unconditionally.

Checks (a broken rule fails the job with the reason): the name follows jobrules/user_metrics.py
(a letter, then up to 63 of `A-Za-z0-9_./-`, not `loss`, `val_loss`, the other per-step metrics
or `hw.*`), the value is a finite real number (a Python number or a one-element tensor), and a job
reports at most 64 distinct names. The values land in the database like the loss and are served by
`GET /api/jobs/{id}/metrics`; a selection batch may rank its trials by one (`metric`, `mode`).

Collection is per thread where the trainer sets a collector for the thread (the selection
executor's device threads, each running one trial's task at a time), else per process (the one
loop: a data loader thread of the job reports into the same step). Only rank 0's values are
recorded.
"""

from __future__ import annotations

import contextlib
import math
import threading
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from jobrules.user_metrics import MAX_NAMES, name_problem

__all__ = ["MetricReportError", "Reports", "collecting", "evaluating", "report"]


class MetricReportError(ValueError):
    """A report that breaks the rules (name, value, too many names)."""


@dataclass(slots=True)
class Reports:
    """The values reported during one step (or one task of a step), by phase: sums and counts,
    so parts collected apart (a selection trial's tasks) merge into the same means."""

    train: dict[str, list[float]] = field(default_factory=dict)
    """name -> [sum, count] reported while training."""
    eval: dict[str, list[float]] = field(default_factory=dict)
    """name -> [sum, count] reported while evaluating."""
    evaluating: bool = False

    def add(self, name: str, value: float) -> None:
        into = self.eval if self.evaluating else self.train
        acc = into.setdefault(name, [0.0, 0])
        acc[0] += value
        acc[1] += 1

    def merge(self, other: Reports) -> None:
        for mine, theirs in ((self.train, other.train), (self.eval, other.eval)):
            for name, (s, n) in theirs.items():
                acc = mine.setdefault(name, [0.0, 0])
                acc[0] += s
                acc[1] += n

    def take(self) -> dict[str, float]:
        """The step's value of each name (an evaluation's mean wins over training's), emptying."""
        out = {name: s / n for name, (s, n) in self.train.items() if n}
        out |= {name: s / n for name, (s, n) in self.eval.items() if n}
        self.train, self.eval = {}, {}
        return out

    def __bool__(self) -> bool:
        return bool(self.train or self.eval)


class NameLimit:
    """The distinct names one job (one trial) reported; the (MAX_NAMES + 1)th is refused."""

    def __init__(self, limit: int = MAX_NAMES) -> None:
        self.limit = limit
        self.names: set[str] = set()

    def check(self, names: Iterable[str]) -> None:
        new = [n for n in names if n not in self.names]
        if len(self.names) + len(new) > self.limit:
            raise MetricReportError(
                f"report({new[0]!r}, ...): a job reports at most {self.limit} distinct metric names of "
                f"its own, and it already has {len(self.names)} ({', '.join(sorted(self.names)[:8])}, ...)"
            )
        self.names.update(new)


_local = threading.local()
_process: Reports | None = None
_process_lock = threading.Lock()


def _current() -> tuple[Reports | None, threading.Lock | None]:
    mine = getattr(_local, "reports", None)
    if mine is not None:
        return mine, None
    return _process, _process_lock


def _value(name: str, value: Any) -> float:
    try:
        if hasattr(value, "numel") and hasattr(value, "item"):  # a tensor (or a numpy array)
            n = value.numel() if callable(value.numel) else value.numel
            if n != 1:
                raise MetricReportError(
                    f"report({name!r}, ...): a tensor value must hold one element, got shape "
                    f"{tuple(value.shape)}"
                )
            value = value.detach().item() if hasattr(value, "detach") else value.item()
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise TypeError(type(value).__name__)
        v = float(value)
    except MetricReportError:
        raise
    except Exception as e:  # noqa: BLE001 - whatever the user passed: one clear error
        raise MetricReportError(
            f"report({name!r}, ...): the value must be a real number or a one-element tensor, got "
            f"{type(value).__name__} ({e})"
        ) from e
    if not math.isfinite(v):
        raise MetricReportError(f"report({name!r}, {v}): the value must be a finite number")
    return v


def report(name: str, value: Any) -> None:
    """Record `value` under `name` at the step being trained (see the module's docstring)."""
    reports, lock = _current()
    if reports is None:
        return
    problem = name_problem(name)
    if problem is not None:
        raise MetricReportError(f"report({name!r}, ...): {problem}")
    v = _value(name, value)
    if lock is None:
        reports.add(name, v)
    else:
        with lock:
            reports.add(name, v)


def evaluating() -> bool:
    """Whether the trainer is evaluating (the fixed validation batches) rather than training."""
    reports, _ = _current()
    return reports is not None and reports.evaluating


@contextlib.contextmanager
def collecting(reports: Reports, *, thread: bool = False) -> Iterator[Reports]:
    """Reports made meanwhile go into `reports`: this thread's only (`thread`), or the whole
    process's (the one loop)."""
    global _process
    if thread:
        before = getattr(_local, "reports", None)
        _local.reports = reports
        try:
            yield reports
        finally:
            _local.reports = before
        return
    with _process_lock:
        before_p, _process = _process, reports
    try:
        yield reports
    finally:
        with _process_lock:
            _process = before_p


@contextlib.contextmanager
def evaluation(reports: Reports) -> Iterator[None]:
    """Reports made meanwhile count as the evaluation's."""
    reports.evaluating = True
    try:
        yield
    finally:
        reports.evaluating = False


def emit(sink: Any, *, step: int, reports: Reports, names: NameLimit) -> dict[str, float]:
    """Send the step's values to `sink` (each name once, at `step`), checking the name limit;
    returns them."""
    values = reports.take()
    if values:
        names.check(values)
        for name, v in values.items():
            sink.metric(step, name, v)
    return values
