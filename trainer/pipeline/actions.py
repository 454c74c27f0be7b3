"""The vocabulary of pipeline schedules: actions, a schedule as each rank's ordered action list, and
the rule of how many micro-batches the message-driven mode admits. The builders
(trainer/pipeline/schedules.py) and the simulator that times them (trainer/pipeline/simulate.py) both
speak it; it lives apart so that the builders can time a candidate order without an import circle.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, NamedTuple

Op = Literal["F", "B", "W", "AR"]
COMPUTE_OPS = ("F", "B", "W")


class Action(NamedTuple):
    """(op, micro-batch, stage, replica); a tuple, because schedules hash many thousands."""

    op: Op
    mb: int
    """Micro-batch index; -1 for AR (it covers every micro-batch of the stage)."""
    stage: int
    replica: int = 0

    def __str__(self) -> str:
        rep = "" if self.replica == 0 else "'"
        return f"{self.op}{self.mb if self.mb >= 0 else ''}{rep}@s{self.stage}"


@dataclass(kw_only=True, slots=True)
class Schedule:
    name: str
    stages: int
    microbatches: int
    replicas: int = 1
    """2 for Chimera (down and up pipelines), 1 otherwise."""
    split_backward: bool = False
    """True when every backward is an input-gradient B plus a weight-gradient W."""
    ranks: list[list[Action]] = field(default_factory=list)
    """ranks[r] is rank r's actions in execution order."""
    dynamic: bool = False
    """True for `async`: the driver reorders the actions as messages arrive."""

    def rank_of(self, *, stage: int, replica: int) -> int:
        return stage if replica == 0 else self.stages - 1 - stage

    def replica_of(self, mb: int) -> int:
        return replica_of(mb, stages=self.stages, replicas=self.replicas)

    def stages_on(self, rank: int) -> list[tuple[int, int]]:
        """(stage, replica) pairs that rank `rank` holds."""
        if self.replicas == 1:
            return [(rank, 0)]
        return [(rank, 0), (self.stages - 1 - rank, 1)]


class ScheduleError(ValueError):
    """A schedule that is incomplete, orders an action before its inputs, or deadlocks."""


def replica_of(mb: int, *, stages: int, replicas: int) -> int:
    """Chimera units hold D micro-batches: the first D/2 go down, the next D/2 go up."""
    if replicas == 1:
        return 0
    return 0 if (mb % stages) < stages // 2 else 1


def async_cap(stages: int) -> int:
    """Micro-batches the message-driven mode lets into the pipeline at once. 1F1B's bound (D)
    leaves it no room to reorder, and it then loses to static 1F1B under compute jitter in
    simulation (bench/pipeline.py); 2D lets it overtake, at up to twice 1F1B's stage-0 stash."""
    return 2 * stages
