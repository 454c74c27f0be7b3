"""Checkpoints: one file per saved step, written atomically, the latest one found by name."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

_PREFIX = "step-"
_SUFFIX = ".pt"


def checkpoint_path(directory: Path, step: int) -> Path:
    return directory / f"{_PREFIX}{step:08d}{_SUFFIX}"


def save_checkpoint(directory: Path, *, step: int, state: dict[str, Any]) -> Path:
    """Write to a temporary name and rename, so a crash never leaves a half-written latest file."""
    directory.mkdir(parents=True, exist_ok=True)
    path = checkpoint_path(directory, step)
    tmp = path.with_suffix(".tmp")
    torch.save({"step": step, **state}, tmp)
    os.replace(tmp, path)
    return path


def latest_checkpoint(directory: Path | None) -> Path | None:
    if directory is None or not directory.is_dir():
        return None
    found = sorted(directory.glob(f"{_PREFIX}*{_SUFFIX}"))
    return found[-1] if found else None


def load_checkpoint(path: Path) -> dict[str, Any]:
    return torch.load(path, map_location="cpu", weights_only=False)
