"""Slurm tests: `make test-slurm` (tests/slurm/cluster.sh) starts a two-node Slurm cluster on this
machine and runs them (`-m slurm`, SHARDYARD_TEST_SLURM=1, SLURM_CONF naming the cluster). Anywhere
else they are not collected: `make test` never starts a Slurm cluster."""

from __future__ import annotations

import os
from pathlib import Path

import pytest


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    if os.environ.get("SHARDYARD_TEST_SLURM") != "1" and collection_path.name != "conftest.py":
        return True
    return None
