"""workers/failures.py against a real torchrun: two ranks under `torch.distributed.run`, one of
them killed by a signal (kill -9 on itself, as the OOM killer would) or exiting with an error; the
worker's reason names the killed rank from torchrun's own failure summary, and a plain error exit
is the job's own failure (no reason, no retry)."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from workers.failures import infrastructure_failure, signal_deaths

RANKS = """
import os, signal, sys, time
if os.environ["RANK"] == "1":
    print("pid", os.getpid(), flush=True)
    if sys.argv[1] == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    sys.exit(3)
time.sleep(60)  # rank 0 lives on: torchrun stops it once rank 1 failed
"""


def _torchrun(tmp_path: Path, how: str, *, script: str = RANKS) -> tuple[int, str, int]:
    path = tmp_path / "ranks.py"
    path.write_text(script)
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            str(path),
            how,
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    pid = int(next(ln.split()[1] for ln in done.stdout.splitlines() if ln.startswith("pid ")))
    return done.returncode, done.stderr, pid


def test_a_rank_killed_by_sigkill_is_named_with_its_pid(tmp_path: Path) -> None:
    rc, stderr, pid = _torchrun(tmp_path, "kill")
    assert rc != 0
    reason = infrastructure_failure(rc=rc, stderr=stderr, oom_before=None)
    assert reason is not None and reason.startswith(
        f"rank 1 (pid {pid}) was killed by SIGKILL (exit code -9)"
    ), (
        reason,
        stderr[-3000:],
    )
    assert [d.rank for d in signal_deaths(rc=rc, stderr=stderr)] == [1]


def test_a_rank_that_exits_with_an_error_is_the_jobs_own_failure(tmp_path: Path) -> None:
    rc, stderr, _ = _torchrun(tmp_path, "exit")
    assert rc != 0 and "exitcode  : 3" in stderr, stderr[-3000:]
    assert infrastructure_failure(rc=rc, stderr=stderr, oom_before=None) is None


def test_a_one_process_trainer_killed_by_a_signal() -> None:
    proc = subprocess.Popen([sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"])
    rc = proc.wait(timeout=60)
    assert infrastructure_failure(rc=rc, stderr="", oom_before=None) == (
        "the trainer was killed by SIGKILL (exit code -9)"
    )
    assert (
        infrastructure_failure(rc=1, stderr="TrainingError: loss is nan at step 3", oom_before=None) is None
    )


OOM_RANK = """
import os, sys, time
if os.environ["RANK"] == "1":
    print("pid", os.getpid(), flush=True)
    with open(sys.argv[1] + "/cgroup.procs", "w") as f:  # into the small cgroup, then past its limit
        f.write(str(os.getpid()))
    hog = bytearray(1 << 30)
    sys.exit(0)
time.sleep(60)
"""


@contextlib.contextmanager
def _small_memory_cgroup(limit: int) -> Iterator[Path]:
    """A child of this process's memory cgroup (v1 or v2) limited to `limit` bytes with no swap:
    a process in it that allocates more is killed by the kernel's OOM killer, for real."""
    lines = Path("/proc/self/cgroup").read_text().splitlines()
    v1 = [ln.split(":", 2)[2] for ln in lines if "memory" in ln.split(":", 2)[1].split(",")]
    if v1:
        base = Path("/sys/fs/cgroup/memory")
        own = base / v1[0].lstrip("/")
        limits = {"memory.limit_in_bytes": limit, "memory.memsw.limit_in_bytes": limit}
    else:
        base = Path("/sys/fs/cgroup")
        own = base / next(ln.split(":", 2)[2] for ln in lines if ln.startswith("0::")).lstrip("/")
        limits = {"memory.max": limit, "memory.swap.max": 0}
    child = (own if own.is_dir() else base) / f"shardyard-test-{uuid.uuid4().hex[:8]}"
    try:
        child.mkdir()
        for name, value in limits.items():
            if (child / name).exists():
                (child / name).write_text(str(value))
    except OSError as e:
        with contextlib.suppress(OSError):
            child.rmdir()
        pytest.skip(f"no memory cgroup of its own can be made here (needs root and a writable cgroup): {e}")
    try:
        yield child
    finally:
        child.rmdir()


def test_a_rank_killed_by_the_kernels_oom_killer_is_named_so(tmp_path: Path) -> None:
    """Rank 1 moves itself into a 64 MiB memory cgroup and allocates 1 GiB: the kernel's OOM killer
    sends it SIGKILL and says so in its log, which the reason must name."""
    with _small_memory_cgroup(64 << 20) as cg:
        rc, stderr, pid = _torchrun(tmp_path, str(cg), script=OOM_RANK)
    reason = infrastructure_failure(rc=rc, stderr=stderr, oom_before=None)
    assert reason == (
        f"rank 1 (pid {pid}) was killed by SIGKILL (exit code -9), by the kernel's OOM killer (the kernel "
        "log says so): the node ran out of memory"
    ), (reason, stderr[-3000:])
