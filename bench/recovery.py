"""Recovery time: from a worker's death to its job running again. Two workers stand by; the one
running the job is killed (SIGKILL of the whole worker, or only its Celery pool process), and the
clock runs until the job is `running` again under a new attempt (lease ran out by database time,
the reconciler or the redelivered message took it back, a worker claimed it), then until its first
new step is stored (adds the trainer's start: a Python that imports torch, the checkpoint load).
Goal: running again within 2 lease periods.

    python -m bench.recovery [--lease 2 5] [--runs 3]
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import tempfile
import time
from pathlib import Path

import httpx

from api.stack import Stack
from bench.common import table, write_results

SPEC = {
    "name": "bench-recovery",
    "model": {"kind": "gpt", "layers": 2, "d_model": 32, "heads": 2, "seq_len": 32},
    "data": {"max_chars": 200_000},
    "train": {"steps": 100_000, "batch_size": 8, "lr": 3e-3, "eval_every": 10_000, "seed": 0},
    "checkpoint_every": 5,
}


def _job(c: httpx.Client, job_id: int) -> dict:
    return c.get(f"/api/jobs/{job_id}").json()


def _until(c: httpx.Client, job_id: int, pred, timeout: float = 300) -> dict:  # noqa: ANN001
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        j = _job(c, job_id)
        if pred(j):
            return j
        time.sleep(0.05)
    raise TimeoutError(f"job {job_id}: {_job(c, job_id)}")


def _ppid(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def _trainer(root: Path, job_id: int) -> int:
    """The job's trainer: the process whose command line names the job's spec (a sandboxed
    trainer's title keeps the host's command line)."""
    spec = str(root / "jobs" / str(job_id) / "spec.json")
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                if spec in Path(f"/proc/{d}/cmdline").read_bytes().replace(b"\0", b" ").decode():
                    return int(d)
            except OSError:
                continue
    raise RuntimeError("no trainer found")


def _pool_and_worker(st: Stack, job_id: int) -> tuple[int, str]:
    """The Celery pool process running the job and the name of its worker: the trainer's ancestor
    whose parent is one of the stack's worker processes (bubblewrap stands between the pool
    process and a sandboxed trainer)."""
    workers = {p.pid: n for n, p in st.procs.items()}
    pid = _trainer(st.root, job_id)
    while pid > 1:
        parent = _ppid(pid)
        if parent in workers:
            return pid, workers[parent]
        pid = parent
    raise RuntimeError(f"job {job_id}'s trainer runs under no worker of the stack")


def one(lease_s: float, fault: str) -> dict:
    env = {
        "SHARDYARD_LEASE_S": str(lease_s),
        "SHARDYARD_RECONCILE_S": str(max(0.5, lease_s / 4)),
        "SHARDYARD_HEARTBEAT_S": str(max(0.25, lease_s / 8)),
        # a dead worker counts as gone as soon as its job's lease runs out: until then the
        # scheduler may place the job back on it (core/settings.py worker_alive_s)
        "SHARDYARD_WORKER_ALIVE_S": str(lease_s),
    }
    with tempfile.TemporaryDirectory() as tmp, Stack(root=Path(tmp), workers=2, extra_env=env) as st:
        c = httpx.Client(
            base_url=st.base_url, timeout=30, headers={"Authorization": f"Bearer {st.admin_token}"}
        )
        job_id = c.post("/api/jobs", json=SPEC).json()["id"]
        _until(c, job_id, lambda j: j["progress"]["step"] >= 10)
        pool, name = _pool_and_worker(st, job_id)
        if fault == "worker":
            proc = st.procs.pop(name)
            t0 = time.monotonic()
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        else:
            t0 = time.monotonic()
            os.kill(pool, signal.SIGKILL)
        _until(c, job_id, lambda j: j["status"] == "running" and j["attempts"] == 2)
        claimed = time.monotonic() - t0
        start = _job(c, job_id)["progress"]["step"]
        _until(c, job_id, lambda j: j["progress"]["step"] > start)
        stepping = time.monotonic() - t0
        c.post(f"/api/jobs/{job_id}/cancel")
        c.close()
    return {"fault": fault, "lease_s": lease_s, "running_again_s": claimed, "first_new_step_s": stepping}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lease", type=float, nargs="+", default=[2.0, 5.0])
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    rows = []
    for lease in args.lease:
        for fault in ("worker", "pool-child"):
            runs = [one(lease, fault) for _ in range(args.runs)]
            claimed = statistics.median(r["running_again_s"] for r in runs)
            stepping = statistics.median(r["first_new_step_s"] for r in runs)
            rows.append(
                {
                    "fault": fault,
                    "lease_s": lease,
                    "runs": len(runs),
                    "running_again_s (median)": round(claimed, 2),
                    "in lease periods": round(claimed / lease, 2),
                    "first new step_s (median)": round(stepping, 2),
                    "max running_again_s": round(max(r["running_again_s"] for r in runs), 2),
                }
            )
            print(table(rows[-1:]))
    load = os.getloadavg()
    title = (
        f"death of a worker -> its job running again (load average {load[0]:.1f} on {os.cpu_count()} cores)"
    )
    print(table(rows, title=title))
    path = write_results("recovery", {"rows": rows, "load_average": load})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
