"""Stop signals (the `stop` a run asks each step) that the trainer tests end a run early with."""

from __future__ import annotations

from trainer.protocol import ListSink


class StopAfter:
    """Asks to stop once `n` steps have been checked (every rank asks alike; the ranks agree by a sum)."""

    def __init__(self, n: int) -> None:
        self.n, self.calls = n, 0

    def requested(self) -> bool:
        self.calls += 1
        return self.calls > self.n


class StopAfterLosses:
    """Asks to stop once `sink` holds `steps` loss points."""

    def __init__(self, sink: ListSink, steps: int) -> None:
        self.sink, self.steps = sink, steps

    def requested(self) -> bool:
        return len(self.sink.series("loss")) >= self.steps
