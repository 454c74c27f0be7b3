"""Process-group set-up from torchrun's environment (RANK, WORLD_SIZE, MASTER_ADDR, ...)."""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist


def env_world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def env_rank() -> int:
    return int(os.environ.get("RANK", "0"))


def init_from_env(*, device_type: str = "cpu", timeout_s: float = 300.0) -> None:
    """Join the process group torchrun described: NCCL on GPUs, gloo on CPU."""
    if dist.is_initialized():
        return
    backend = "nccl" if device_type == "cuda" else "gloo"
    if device_type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend=backend, timeout=timedelta(seconds=timeout_s))


def teardown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
