"""Device choice and memory readings."""

from __future__ import annotations

import resource
import sys

import torch


def pick_device(requested: str) -> torch.device:
    if requested == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("resources.device is 'cuda' but this machine has no CUDA device")
    if requested == "cuda" or (requested == "auto" and torch.cuda.is_available()):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def peak_memory_mb(device: torch.device) -> float:
    """Peak device memory on CUDA; peak resident set size of this process on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # note: ru_maxrss is KiB on Linux and bytes on macOS
    return rss / (2**20 if sys.platform == "darwin" else 2**10)


def describe_devices() -> list[dict[str, object]]:
    """What this machine offers, for the worker heartbeat."""
    out: list[dict[str, object]] = []
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(i)
            out.append(
                {
                    "type": "cuda",
                    "index": i,
                    "name": props.name,
                    "memory_mb": props.total_memory // 2**20,
                }
            )
    out.append({"type": "cpu", "index": 0, "name": "cpu", "cores": torch.get_num_threads()})
    return out
