"""What the selection executor keeps: a trial as asked (TrialEntry), a trial as it runs (TrialRun),
one task as it ran (Slot), and the batch's shared state that every part of the executor reads and
changes under one lock (Batch)."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch

from jobrules.spec import JobSpec
from trainer.protocol import MetricsSink
from trainer.report import NameLimit, Reports
from trainer.selection.executor_config import ExecutorConfig
from trainer.selection.halving import Halving, StopReason
from trainer.selection.shards import ShardedTrial

Status = Literal["pending", "running", "paused", "succeeded", "stopped_early", "stopped", "failed"]
FINAL = ("succeeded", "stopped_early", "stopped", "failed")
BuildError = tuple[Exception, str]
"""Why a trial could not be built on the host: the error and its traceback."""


@dataclass(kw_only=True, slots=True)
class TrialEntry:
    index: int
    job: JobSpec
    sink: MetricsSink
    checkpoint_dir: Path | None = None
    warm_start: Path | None = None
    """A checkpoint (file or directory) whose weights this trial starts from."""


@dataclass(kw_only=True, slots=True)
class Slot:
    """One task as it ran, for tests and the benchmark."""

    trial: int
    device: int
    kind: str
    shard: int
    start: float
    end: float
    compute_s: float
    copy_s: float


@dataclass(kw_only=True, slots=True)
class TrialRun:
    entry: TrialEntry
    trial: ShardedTrial | None = None
    status: Status = "pending"
    holder: int | None = None
    """Device that holds the trial (running a task, or reserved after a prefetch)."""
    stop_requested: bool = False
    last_dispatch: int = -1
    step_times: list[float] = field(default_factory=list)
    done_in_step_s: float = 0.0
    last_metric: float | None = None
    best_metric: float | None = None
    val_loss: float = float("nan")
    reports: Reports = field(default_factory=Reports)
    """What the trial's own code reported during its running step (trainer/report.py)."""
    names: NameLimit = field(default_factory=NameLimit)
    error: str | None = None
    compute_s: float = 0.0
    copy_s: float = 0.0
    busy_s: float = 0.0
    """Device-thread time spent on this trial's own tasks (task, evaluation, bookkeeping after it;
    a prefetch of another trial made in the same slot is not counted)."""
    dispatch_s: float = 0.0
    """Device-thread time from the device being free to this trial's task starting, minus waits
    for work: the policy's choice, the lock, the reservations."""
    prefetch_s: float = 0.0
    """Of copy_s, the part copied by a prefetch (in another trial's slot)."""
    started: bool = False
    stop_reason: StopReason | None = None
    """Why the rungs stopped the trial (its rung, its value, the rung's cut-off)."""
    prefetches: int = 0
    """Times a device reserved the trial as its next one while running another (double buffering)."""
    pinned: int | None = None
    """Device processes: the device whose process holds the trial's mini-batch in progress (or, for a
    trial whose data carries state, the trial for good); only it may take the trial's next task."""
    block: torch.Tensor | None = None
    """Device processes: the trial's shared-memory block (ShardedTrial.share); None once the
    trial has ended (released)."""
    orders: int = 0
    """Device processes: orders sent for this trial (one task each, or a chunk of a lone trial's)."""
    released: bool = False
    """The trial has ended and its tensors (and, with device processes, its block) were let go."""

    @property
    def index(self) -> int:
        return self.entry.index

    @property
    def sink(self) -> MetricsSink:
        return self.entry.sink


@dataclass(kw_only=True, slots=True)
class Batch:
    """The state the executor's parts share. Every field changes under `cond`; a trial's tensors
    are touched only by the device that holds it, outside the lock."""

    cfg: ExecutorConfig
    runs: dict[int, TrialRun]
    processes: bool
    """CPU devices run as processes (trainer/selection/devices.py)."""
    grows: bool
    """The batch grows as it runs (the executor was given `more`)."""
    cond: threading.Condition = field(default_factory=threading.Condition)
    rungs: Halving | None = None
    """Early stopping's rungs, set once the run has built its trials; None: none (yet)."""
    stopping: bool = False
    """The whole batch was asked to stop."""
    fatal: BaseException | None = None
    """A bug in the executor itself, met by a device thread: every device stops."""
    waiting: int = 0
    """Devices waiting for a trial to run."""
    trace: list[Slot] = field(default_factory=list)

    def ended(self) -> int:
        return sum(r.status in FINAL for r in self.runs.values())
