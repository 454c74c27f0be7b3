"""Time accounting of the selection executor: what a trial's mini-batch costs (measured, or
estimated from its flops until it is), for the policy's choice; and where a device's time goes
in one slot (waiting for work, dispatch, the task and its booking, a prefetch of another trial)."""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field

from trainer.selection.trial_run import TrialRun


class StepTimes:
    """Each trial's mini-batch time, as the policy sees it (not the fusion plan's step costs:
    step_costs.py)."""

    def __init__(self) -> None:
        self.flops_rate: float | None = None
        """Flops a second the measured trials achieve together; None until one is measured."""

    def step_time(self, run: TrialRun) -> float:
        """Measured mean mini-batch time, or an estimate from the trial's flops at the rate the
        measured trials achieve (before any is measured, a nominal rate: only the order matters)."""
        if run.step_times:
            return sum(run.step_times) / len(run.step_times)
        return run.trial.flops_per_step / (self.flops_rate or 1e10)

    def measure(self, runs: Iterable[TrialRun]) -> None:
        """Under the lock, at a trial's mini-batch end: the rate over every measured step."""
        measured = [r for r in runs if r.step_times]
        self.flops_rate = sum(r.trial.flops_per_step * len(r.step_times) for r in measured) / sum(
            sum(r.step_times) for r in measured
        )


@dataclass(slots=True)
class SlotTimer:
    """One device's clock over one slot: from the device being free to its trial's task booked."""

    free: float = field(default_factory=time.perf_counter)
    waited: float = 0.0
    """Time with no trial to run (waiting for one, or asking `more` for one)."""
    start: float = 0.0
    """When the slot's trial was dispatched."""
    prefetch: float = 0.0
    """Of the slot, the time spent starting another trial's prefetch."""

    def waited_since(self, t0: float) -> float:
        """Count the time since `t0` (perf_counter) as waiting for work; returns it."""
        dt = time.perf_counter() - t0
        self.waited += dt
        return dt

    def begin(self, run: TrialRun) -> None:
        """The trial is dispatched: the time since the device was free, less the waits, is its
        dispatch time."""
        self.start = time.perf_counter()
        run.dispatch_s += self.start - self.free - self.waited

    def prefetched(self) -> None:
        self.prefetch = time.perf_counter() - self.start

    def end(self, run: TrialRun) -> None:
        """The trial's task is booked: the slot, less the prefetch, was the trial's busy time."""
        run.busy_s += time.perf_counter() - self.start - self.prefetch
