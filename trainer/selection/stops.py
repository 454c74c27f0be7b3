"""The stop signals of a selection batch, read while it runs: the whole batch's and each trial's
own; a trial stops between mini-batches, never in the middle of one."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from trainer.protocol import StopSignal
from trainer.selection.trial_ends import Ends
from trainer.selection.trial_run import FINAL, Batch


@dataclass(kw_only=True, slots=True, eq=False)
class Stops:
    """Under the batch's lock, at most every `poll_s`: mark the trials asked to stop, and stop
    those no device holds between mini-batches."""

    batch: Batch
    ends: Ends
    stop: StopSignal
    """The whole batch's."""
    stop_trials: Callable[[], set[int]]
    """The trials asked to stop on their own."""
    _last_poll: float = field(default=0.0, init=False)

    def poll(self) -> None:
        b = self.batch
        now = time.monotonic()
        if now - self._last_poll < b.cfg.poll_s:
            return
        self._last_poll = now
        if not b.stopping and self.stop.requested():
            b.stopping = True
        wanted = self.stop_trials()
        for run in b.runs.values():
            if run.status in FINAL:
                continue
            if b.stopping or run.index in wanted:
                run.stop_requested = True
            # a trial between mini-batches and held by no device stops now; one mid-mini-batch
            # finishes it first (its shards would otherwise hold half an optimizer step)
            if run.stop_requested and run.holder is None and run.trial is not None and run.trial.pos == 0:
                self.ends.finish(run, "stopped")
