"""workers/failures.py against a real torchrun: two ranks under `torch.distributed.run`, one of
them killed by a signal (kill -9 on itself, as the OOM killer would) or exiting with an error; the
worker's reason names the killed rank from torchrun's own failure summary, and a plain error exit
is the job's own failure (no reason, no retry)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

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


def _torchrun(tmp_path: Path, how: str) -> tuple[int, str, int]:
    script = tmp_path / "ranks.py"
    script.write_text(RANKS)
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            str(script),
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
