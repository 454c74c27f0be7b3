"""A trainer beside the service takes the CPU priority the worker's settings give it
(`SHARDYARD_TRAINER_NICE`, trainer/priority.py): its session as a whole and every thread, read
from outside while it trains. Renicing from outside does not reach the session: most kernels share
the CPU between sessions before nice values count, and a trainer runs in one of its own."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from core.settings import Settings
from tests.proc_tree import process_tree
from workers.sandbox import Sandbox, probe

JOB = {
    "name": "busy",
    "model": {"kind": "mlp", "layers": 1, "d_model": 16, "seq_len": 8},
    "data": {"max_chars": 20_000},
    "train": {"steps": 1_000_000, "batch_size": 2, "eval_every": 100_000, "eval_batches": 1},
}


@pytest.fixture(autouse=True)
def _our_session_keeps_its_priority() -> Iterator[None]:
    """No trainer here may renice the session of the tests that start it (a CI run, whose every
    other test it would slow down): each runs in a session of its own, as a worker starts it."""
    before = _autogroup(os.getpid())
    yield
    assert _autogroup(os.getpid()) == before


def _autogroup(pid: int) -> tuple[str, int] | None:
    """(its autogroup's name, that group's nice value), None without autogroups."""
    try:
        name, _, nice = Path(f"/proc/{pid}/autogroup").read_text().split()
    except (OSError, ValueError):
        return None
    return name, int(nice)


def _nices(pid: int) -> list[int]:
    """The nice value of each of `pid`'s threads."""
    out = []
    for tid in os.listdir(f"/proc/{pid}/task"):
        stat = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
        out.append(int(stat.rsplit(")", 1)[1].split()[16]))
    return out


def _trainer_priority(
    tmp_path: Path, *, sandbox: str, nice: int
) -> tuple[int, list[int], tuple[str, int] | None]:
    """Start `python -m trainer` as the worker does (in its own session, in the sandbox or not),
    wait for its first step, and read its nice values and autogroup from outside."""
    job = tmp_path / "job"
    job.mkdir()
    (job / "spec.json").write_text(json.dumps(JOB))
    settings = Settings(data_dir=tmp_path / "data", sandbox=sandbox, trainer_nice=nice)
    box = Sandbox(settings=settings, read_write=[job], user_code=False)
    cmd = box.command([sys.executable, "-m", "trainer", "--spec", str(job / "spec.json")])
    proc = subprocess.Popen(
        cmd, env=box.environment(), stdout=subprocess.PIPE, text=True, start_new_session=True, cwd=job
    )
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            if '"metric"' in line or '"step"' in line:
                break
        else:
            pytest.fail(f"the trainer ended before its first step: {proc.wait()}")
        # the python process itself (bubblewrap's two processes stand above it in the sandbox)
        trainer = next(
            p
            for p in process_tree([proc.pid])
            if Path(f"/proc/{p}/cmdline").read_bytes().split(b"\0")[1:3] == [b"-m", b"trainer"]
        )
        return trainer, _nices(trainer), _autogroup(trainer)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


@pytest.mark.parametrize("sandbox", ["on", "off"])
def test_a_trainer_takes_its_nice_value_for_its_session_and_every_thread(
    tmp_path: Path, sandbox: str
) -> None:
    if sandbox == "on" and probe() is not None:
        pytest.skip(f"bubblewrap cannot run here: {probe()}")
    _, nices, group = _trainer_priority(tmp_path, sandbox=sandbox, nice=12)
    assert set(nices) == {12}, nices  # every thread it has
    mine = _autogroup(os.getpid())
    if mine is None:
        return  # no autogroups on this kernel: the threads' nice value is what counts
    assert group is not None and group[0] != mine[0]  # a session of its own ...
    assert group[1] == 12  # ... at the nice value asked for, as a whole


def test_without_the_setting_a_trainer_keeps_the_workers_priority(tmp_path: Path) -> None:
    _, nices, group = _trainer_priority(tmp_path, sandbox="off", nice=0)
    assert set(nices) == {os.getpriority(os.PRIO_PROCESS, 0)}
    assert group is None or group[1] == 0


def test_a_nice_value_out_of_range_is_refused() -> None:
    for bad in (-1, 20):
        with pytest.raises(ValueError, match="trainer_nice must be 0-19"):
            Settings(trainer_nice=bad)


def test_trainers_that_start_together_all_get_their_sessions_nice_value(tmp_path: Path) -> None:
    """The kernel takes one session's nice value every tenth of a second from a process without
    CAP_SYS_ADMIN (a sandboxed trainer): six sandboxed trainers started at once each take their
    turn (the first tried once, and four of ten in a run kept the API's share)."""
    if probe() is not None:
        pytest.skip(f"bubblewrap cannot run here: {probe()}")
    settings = Settings(data_dir=tmp_path / "data", sandbox="on", trainer_nice=12)
    procs = []
    try:
        for k in range(6):
            job = tmp_path / f"job{k}"
            job.mkdir()
            box = Sandbox(settings=settings, read_write=[job], user_code=False)
            code = "from trainer.priority import yield_cpu; yield_cpu(); import time; time.sleep(60)"
            cmd = box.command([sys.executable, "-c", code])
            procs.append(subprocess.Popen(cmd, env=box.environment(), start_new_session=True, cwd=job))
        deadline = time.monotonic() + 20
        while True:
            inner = [
                next(
                    p
                    for p in process_tree([proc.pid])
                    if b"yield_cpu" in Path(f"/proc/{p}/cmdline").read_bytes()
                )
                for proc in procs
            ]
            groups = [_autogroup(p) for p in inner]
            if None in groups or all(g is not None and g[1] == 12 for g in groups):
                break
            assert time.monotonic() < deadline, groups
            time.sleep(0.2)
        if None not in groups:
            assert len({g[0] for g in groups if g is not None}) == 6  # six sessions, each at 12
    finally:
        for proc in procs:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _python_yielding(code: str, *, nice: int) -> subprocess.CompletedProcess[str]:
    """`python -c code` with SHARDYARD_TRAINER_NICE=`nice`, in a session of its own as a worker
    starts a trainer (its session's nice value is then its own, not the tests')."""
    env = {**os.environ, "SHARDYARD_TRAINER_NICE": str(nice)}
    return subprocess.run(
        [sys.executable, "-c", code],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        start_new_session=True,
    )


def test_threads_started_before_it_yields_yield_too() -> None:
    """Importing torch starts a thread before the trainer's first line runs: that one and the
    threads started after all take the nice value."""
    code = (
        "import threading, os, pathlib\n"
        "ev = threading.Event(); threading.Thread(target=ev.wait, daemon=True).start()\n"
        "from trainer.priority import yield_cpu\n"
        "yield_cpu()\n"
        "threading.Thread(target=ev.wait, daemon=True).start()\n"
        "def nice(t):\n"
        "    try: return int(pathlib.Path(f'/proc/self/task/{t}/stat').read_text().rsplit(')', 1)[1].split()[16])\n"
        "    except FileNotFoundError: return None  # ended: the session's own, its work done\n"
        "print([n for n in map(nice, os.listdir('/proc/self/task')) if n is not None])\n"
    )
    out = _python_yielding(code, nice=7)
    assert out.returncode == 0, out.stderr
    nices = json.loads(out.stdout)
    assert len(nices) >= 3 and set(nices) == {7}, nices


@pytest.mark.parametrize("module", ["trainer", "trainer.selection"])
def test_both_programs_a_worker_starts_yield(module: str) -> None:
    """A job's trainer and a selection batch's both take the nice value before their first line."""
    code = (
        "import os, runpy, sys\n"
        f"sys.argv = [{module!r}, '--help']\n"
        "try:\n"
        f"    runpy.run_module({module!r}, run_name='__main__', alter_sys=True)\n"
        "except SystemExit:\n"
        "    pass\n"
        "print(os.getpriority(os.PRIO_PROCESS, 0), file=sys.stderr)\n"
    )
    out = _python_yielding(code, nice=9)
    assert out.stderr.strip().splitlines()[-1] == "9", out.stderr
