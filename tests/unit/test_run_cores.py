"""A worker that runs several jobs at once gives each run its share of the host's cores
(workers/cores.py), and the run keeps its torch threads to it (trainer/priority.py use_cores):
split between the run's processes on the host, in a job and in a selection batch's devices."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from core.settings import Settings
from trainer.selection.devices import threads_per_device
from workers import cores
from workers.sandbox import Sandbox

ROOT = Path(__file__).resolve().parents[2]


def _threads_after_use_cores(env: dict[str, str]) -> tuple[str, int]:
    """In a fresh process (its torch threads are its own): what use_cores returned, and torch's
    thread count after."""
    code = (
        "import torch\nfrom trainer.priority import use_cores\nprint(use_cores(), torch.get_num_threads())\n"
    )
    mine = ("SHARDYARD_TRAINER_CORES", "LOCAL_WORLD_SIZE", "OMP_NUM_THREADS")
    base = {k: v for k, v in os.environ.items() if k not in mine}
    out = subprocess.run(
        [sys.executable, "-c", code],
        env={**base, **env},
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    got, threads = out.stdout.split()
    return got, int(threads)


def test_a_run_keeps_its_torch_threads_to_the_cores_it_is_given() -> None:
    default = _threads_after_use_cores({})
    assert default[0] == "None"
    assert _threads_after_use_cores({"SHARDYARD_TRAINER_CORES": "3"}) == ("3", 3)
    # torchrun's ranks on this host share the run's cores; never below one thread
    assert _threads_after_use_cores({"SHARDYARD_TRAINER_CORES": "4", "LOCAL_WORLD_SIZE": "2"}) == ("2", 2)
    assert _threads_after_use_cores({"SHARDYARD_TRAINER_CORES": "1", "LOCAL_WORLD_SIZE": "4"}) == ("1", 1)
    # OMP_NUM_THREADS, where the worker's environment sets it (torchrun does for its ranks), caps it
    assert _threads_after_use_cores({"SHARDYARD_TRAINER_CORES": "4", "OMP_NUM_THREADS": "1"}) == ("1", 1)
    assert _threads_after_use_cores({"SHARDYARD_TRAINER_CORES": "2", "OMP_NUM_THREADS": "8"}) == ("2", 2)
    # anything but a whole number >= 1 is no share: torch's default stays
    for bad in ("0", "-2", "two", ""):
        assert _threads_after_use_cores({"SHARDYARD_TRAINER_CORES": bad}) == default, bad


def test_a_worker_gives_each_run_its_cores_over_its_concurrency(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(cores, "_TASKS", [])
    monkeypatch.setattr(cores, "_CORES", [])
    monkeypatch.setattr(cores, "_FIXED", [])
    settings = Settings(data_dir=tmp_path)
    assert cores.run_share(settings) is None  # no worker said how many runs it holds
    assert "SHARDYARD_TRAINER_CORES" not in Sandbox(settings=settings, read_write=[tmp_path]).environment()
    host = len(os.sched_getaffinity(0))
    for tasks in (1, 2, host + 3):
        cores.set_tasks(tasks)
        want = max(1, host // tasks)
        assert cores.run_share(settings) == want
        env = Sandbox(settings=settings, read_write=[tmp_path]).environment()
        assert env["SHARDYARD_TRAINER_CORES"] == str(want), tasks
    # the worker's CPU budget (a container's CPU quota) is what is shared, not the host's CPUs
    cores.set_tasks(2, cores=7)
    assert cores.run_share(settings) == 3
    cores.set_tasks(2, cores=1)
    assert cores.run_share(settings) == 1
    # the operator's setting wins, worker or not
    fixed = Settings(data_dir=tmp_path, trainer_cores=5)
    assert Sandbox(settings=fixed, read_write=[tmp_path]).environment()["SHARDYARD_TRAINER_CORES"] == "5"
    monkeypatch.setattr(cores, "_TASKS", [])
    assert cores.run_share(fixed) == 5
    # the Slurm node agent's run: the CPUs of its allocation, whatever the host has; the
    # operator's setting can lower it, never raise it
    cores.set_tasks(2)
    cores.set_share(3)
    assert cores.run_share(settings) == 3 and cores.run_share(fixed) == 3
    assert cores.run_share(Settings(data_dir=tmp_path, trainer_cores=2)) == 2


def test_a_selection_batchs_devices_share_the_runs_cores(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)  # tests/conftest.py sets 1
    monkeypatch.setenv("SHARDYARD_TRAINER_CORES", "6")
    assert [threads_per_device(n) for n in (1, 2, 4, 8)] == [6, 3, 1, 1]
    # OMP_NUM_THREADS in the worker's environment caps a device's threads, as a job's
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert [threads_per_device(n) for n in (1, 2, 4, 8)] == [2, 2, 1, 1]
    monkeypatch.delenv("OMP_NUM_THREADS")
    monkeypatch.delenv("SHARDYARD_TRAINER_CORES")
    assert threads_per_device(1) == len(os.sched_getaffinity(0))
