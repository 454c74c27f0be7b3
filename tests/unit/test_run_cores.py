"""A worker that runs several jobs at once gives each run its share of the host's cores
(workers/cores.py), and the run keeps its torch threads to it (trainer/priority.py use_cores):
split between the run's processes on the host, in a job and in a selection batch's devices."""

from __future__ import annotations

import ast
import multiprocessing
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import billiard.process
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
    monkeypatch.setattr(cores, "_FIXED", [])
    monkeypatch.setattr(cores, "_BOARD", [])
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
    monkeypatch.setenv("SHARDYARD_TRAINER_CORES", "6")
    assert [threads_per_device(n) for n in (1, 2, 4, 8)] == [6, 3, 1, 1]
    monkeypatch.delenv("SHARDYARD_TRAINER_CORES")
    assert threads_per_device(1) == len(os.sched_getaffinity(0))


def _seat_in_a_pool_process(settings: Settings, path: Path, slot: int, ready: Any) -> None:
    cores.Seat(settings, path, follows=False, slot=slot)  # a selection batch's run: its share fixed
    ready.set()
    time.sleep(120)


def test_a_jobs_share_follows_the_runs_seated_beside_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(cores, "_TASKS", [])
    monkeypatch.setattr(cores, "_CORES", [])
    monkeypatch.setattr(cores, "_FIXED", [])
    monkeypatch.setattr(cores, "_BOARD", [])
    cores.set_tasks(3)  # made before the pool processes are forked, as at Celery's worker_init
    settings = Settings(data_dir=tmp_path)
    host = len(os.sched_getaffinity(0))
    assert host >= 2, "a share that changes needs a host of two cores or more"
    path = tmp_path / "cores"
    # a pool process sits in the slot of its index in the pool (billiard's)
    monkeypatch.setattr(billiard.process.current_process(), "index", 0, raising=False)
    seat = cores.Seat(settings, path, follows=True)
    assert seat.slot == 0 and list(cores._BOARD[0]) == [os.getpid(), 0, 0]
    # alone on the worker: every core
    assert seat.environment() == {
        "SHARDYARD_TRAINER_CORES": str(host),
        "SHARDYARD_TRAINER_CORES_FILE": str(path),
    }
    assert path.read_text() == f"{host}\n"
    ctx = multiprocessing.get_context("fork")
    others = []
    for n in (2, 3):
        ready = ctx.Event()
        p = ctx.Process(target=_seat_in_a_pool_process, args=(settings, tmp_path / f"other{n}", n - 1, ready))
        p.start()
        others.append(p)
        assert ready.wait(30)
        assert cores.seated() == n
        seat.update()
        assert path.read_text() == f"{max(1, host // n)}\n", n
    assert not (tmp_path / "other2").exists()  # a run whose share is fixed is given no file
    # a run with no slot (not a prefork pool process) sits nowhere and does not follow
    assert not cores.Seat(settings, tmp_path / "extra", follows=True, slot=None).follows
    assert cores.seated() == 3
    # a pool process killed with its run: its slot counts no more once it is gone
    os.kill(others[0].pid, signal.SIGKILL)
    others[0].join()
    seat.update()
    assert cores.seated() == 2 and path.read_text() == f"{max(1, host // 2)}\n"
    # the trainer (users' code) replaced its cores file with a link: the worker replaces the link,
    # it never writes through it
    outside = tmp_path / "outside.txt"
    outside.write_text("keep\n")
    path.unlink()
    path.symlink_to(outside)
    others[1].kill()
    others[1].join()
    seat.update()
    assert path.read_text() == f"{host}\n"
    assert not path.is_symlink() and outside.read_text() == "keep\n"
    seat.leave()
    assert cores.seated() == 0
    # the process that replaces a dead one takes its index: it empties the slot first, which may
    # hold the dead one's pid (reused by now by another process: here, this one)
    cores._BOARD[0][2] = os.getpid()
    monkeypatch.setattr(billiard.process.current_process(), "index", 2, raising=False)
    assert cores.seated() == 1
    cores.clear_slot()
    assert cores.seated() == 0
    # a fixed share (the operator's SHARDYARD_TRAINER_CORES) does not follow
    fixed = cores.Seat(Settings(data_dir=tmp_path, trainer_cores=1), tmp_path / "fixed", follows=True)
    assert fixed.environment() == {} and not (tmp_path / "fixed").exists()
    fixed.leave()
    assert cores.seated() == 0
    # the worker's CPU budget (a container's CPU quota) is what is shared, not the host's CPUs
    cores.set_tasks(2, cores=1)
    assert cores.Seat(settings, path, follows=True, slot=0).environment()["SHARDYARD_TRAINER_CORES"] == "1"


FOLLOW = """
import sys
from pathlib import Path
import torch
from trainer.priority import CoreShare, use_cores
p = Path(sys.argv[1])
out = [use_cores()]
share = CoreShare(every_s=0)
for text in ("1\\n", "1\\n", "lots", "", "3", "0"):
    p.write_text(text)
    out.append((share.follow(), torch.get_num_threads()))
p.unlink()
out.append((share.follow(), torch.get_num_threads()))
p.write_text("2")
out.append((CoreShare(every_s=60).follow(), torch.get_num_threads()))  # read at most every 60 s
print(out)
"""


@pytest.mark.parametrize("omp", ["", "1"])
def test_a_trainer_takes_its_new_share_between_steps(tmp_path: Path, omp: str) -> None:
    mine = ("SHARDYARD_TRAINER_CORES", "SHARDYARD_TRAINER_CORES_FILE", "LOCAL_WORLD_SIZE", "OMP_NUM_THREADS")
    env = {k: v for k, v in os.environ.items() if k not in mine}
    env.update({"SHARDYARD_TRAINER_CORES": "2", "SHARDYARD_TRAINER_CORES_FILE": str(tmp_path / "cores")})
    if omp:
        env["OMP_NUM_THREADS"] = omp
    out = subprocess.run(
        [sys.executable, "-c", FOLLOW, str(tmp_path / "cores")],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    got = ast.literal_eval(out.stdout.strip())
    if not omp:
        # 2 -> 1 -> 3 cores; what is not a whole number >= 1, or no file, changes nothing
        assert got == [2, (1, 1), (None, 1), (None, 1), (None, 1), (3, 3), (None, 3), (None, 3), (None, 3)]
    else:
        # the operator's OMP_NUM_THREADS caps the threads; the share's changes are still taken
        assert got == [1, (1, 1), (None, 1), (None, 1), (None, 1), (1, 1), (None, 1), (None, 1), (None, 1)]
