"""Tensor-parallel pieces the composed engine (trainer/engine.py) reports: the communication ledger
of the run, gathered from every rank. The layers themselves are applied by trainer/parallelize.py.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from jobrules.spec import TensorSpec
from trainer.tensor import comm
from trainer.tensor.grid import Grid1D, TensorGrid


def comm_summary(*, grid: TensorGrid, steps: int) -> dict[str, Any]:
    """This run's ledger: per rank totals (gathered from every rank), rank 0's per-layer and per-op
    breakdown, and the per-step averages."""
    mine = comm.LEDGER.total()
    fwd, bwd = comm.LEDGER.total(phase="fwd"), comm.LEDGER.total(phase="bwd")
    row = {"total": mine.as_dict(), "fwd": fwd.as_dict(), "bwd": bwd.as_dict()}
    per_rank: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(per_rank, row)
    q = grid.size if isinstance(grid, Grid1D) else grid.q
    return {
        "mode": grid.mode,
        "world_size": dist.get_world_size(),
        "q": None if isinstance(grid, Grid1D) else q,
        "d": None if isinstance(grid, Grid1D) else grid.d,
        "steps": steps,
        "per_rank": per_rank,
        "sent_bytes_per_step_rank0": (mine.as_dict()["sent_bytes"] / steps) if steps else 0.0,
        "calls_per_step_rank0": (mine.calls / steps) if steps else 0.0,
        "by_layer_rank0": comm.LEDGER.by_layer(),
        "by_op_rank0": comm.LEDGER.by_op(),
    }


def tensor_summary(*, grid: TensorGrid, tensor: TensorSpec, steps: int) -> dict[str, Any]:
    """The tensor-parallel result keys, and under "comm" the run's ledger for the `comm` event
    (every rank calls this: it gathers)."""
    with comm.paused():
        summary = comm_summary(grid=grid, steps=steps)
    return {
        "tensor": {"mode": tensor.mode, "world_size": tensor.world_size},
        "comm_sent_bytes_per_step_rank0": summary["sent_bytes_per_step_rank0"],
        "comm": summary,
    }
