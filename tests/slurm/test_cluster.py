"""The cluster make test-slurm started: two idle nodes answering Slurm's commands."""

from __future__ import annotations

import subprocess

import pytest

pytestmark = pytest.mark.slurm


def test_two_idle_nodes() -> None:
    out = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %t"], capture_output=True, text=True, check=True)
    assert sorted(out.stdout.split()) == ["idle", "idle", "n1", "n2"], out.stdout
