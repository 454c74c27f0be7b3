"""How a selection batch's executor runs: its config (the ranking, early stopping, the checkpoint
policy, prefetch, the device budget, how devices run and talk) and whether its devices are processes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from jobrules.spec import CHECKPOINT_POLICIES, BatchRules
from jobrules.user_metrics import ranked_metric_problem
from trainer.selection.halving import HalvingConfig
from trainer.selection.policy import make_policy

_REQUEST = BatchRules()
"""The selection request's defaults (jobrules/spec.py), for an executor built without one."""


@dataclass(kw_only=True, slots=True)
class ExecutorConfig:
    scheduler: str = _REQUEST.scheduler
    metric: str = _REQUEST.metric
    """What ASHA and the leaderboard rank by: loss, val_loss or a metric the trials' own code
    reports (trainer/report.py)."""
    mode: Literal["min", "max"] = _REQUEST.mode
    early_stopping: HalvingConfig | None = None
    """ASHA, successive halving or Hyperband rungs (trainer/selection/halving.py); None: none."""
    checkpoints: str = _REQUEST.checkpoints
    """Which end-of-trial checkpoints stay once trials end: the best trial's (`best`), every
    trial's (`all`) or none (`none`); a trial's directory goes with them."""
    prefetch: bool = True
    """Copy the next chosen trial's shard in while the current one computes."""
    device_budget_bytes: int | None = None
    """Each device's budget; None: unlimited (CPU devices)."""
    poll_s: float = 0.05
    """How often an idle device re-reads the stop signals."""
    device_processes: bool | None = None
    """Run each CPU device as a forked process (trainer/selection/devices.py) rather than a thread
    of this one; None: processes when there are several CPU devices, threads otherwise (one
    device, or CUDA, which cannot be forked once initialised)."""
    chunk_tasks: int = 256
    """Device processes: the most tasks one order may carry when no other trial could use the
    device meanwhile (a lone trial); 1: one task an order, always."""
    send_ahead: bool = True
    """Device processes: send the order of the trial a device reserved to run next as soon as its
    running order's last task ends, before that task is booked (DeviceTasks.send_ahead in
    trainer/selection/device_tasks.py); False: each order once the one before is booked."""

    def __post_init__(self) -> None:
        if (problem := ranked_metric_problem(self.metric)) is not None:
            raise ValueError(problem)
        if self.mode not in ("min", "max"):
            raise ValueError(f"mode must be min or max, got {self.mode!r}")
        make_policy(self.scheduler)  # names the valid ones
        if self.checkpoints not in CHECKPOINT_POLICIES:
            raise ValueError(
                f"checkpoints must be one of {', '.join(CHECKPOINT_POLICIES)}, got {self.checkpoints!r}"
            )
        if self.device_budget_bytes is not None and self.device_budget_bytes <= 0:
            raise ValueError(f"device budget must be > 0 bytes, got {self.device_budget_bytes}")
        if self.chunk_tasks < 1:
            raise ValueError(f"chunk_tasks must be >= 1, got {self.chunk_tasks}")


def uses_processes(cfg: ExecutorConfig, devices: list[torch.device]) -> bool:
    """Whether the devices run as forked device processes: as `cfg.device_processes` says, and
    by default when there are several CPU devices (one device, or CUDA: threads)."""
    if cfg.device_processes is not None:
        return cfg.device_processes
    return all(d.type == "cpu" for d in devices) and len(devices) > 1
