"""Recovery time: from a worker's death (SIGKILL of the whole worker) to its job running again on
a restarted worker, and from a pool process's death (Celery restarts it) to the same, for a few
lease periods. Goal: within 2 lease periods.

    python -m bench.recovery [--lease 2 5] [--runs 3]

The restarted worker starts right after the kill, so the time also holds its start (Celery and
the trainer's torch import); the table shows the lease period and the ratio to it.
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


def _pool_child(root: Path, job_id: int) -> int:
    spec = str(root / "jobs" / str(job_id) / "spec.json")
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                if spec in Path(f"/proc/{d}/cmdline").read_bytes().replace(b"\0", b" ").decode():
                    return int(Path(f"/proc/{d}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except OSError:
                continue
    raise RuntimeError("no trainer found")


def one(lease_s: float, fault: str) -> dict:
    env = {
        "SHARDYARD_LEASE_S": str(lease_s),
        "SHARDYARD_RECONCILE_S": str(max(0.5, lease_s / 4)),
        "SHARDYARD_HEARTBEAT_S": str(max(0.25, lease_s / 8)),
    }
    with tempfile.TemporaryDirectory() as tmp, Stack(root=Path(tmp), extra_env=env) as st:
        c = httpx.Client(
            base_url=st.base_url, timeout=30, headers={"Authorization": f"Bearer {st.admin_token}"}
        )
        job_id = c.post("/api/jobs", json=SPEC).json()["id"]
        _until(c, job_id, lambda j: j["progress"]["step"] >= 10)
        if fault == "worker":
            proc = st.procs.pop("worker1")
            t0 = time.monotonic()
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            st.start_worker(1)
        else:
            pid = _pool_child(st.root, job_id)
            t0 = time.monotonic()
            os.kill(pid, signal.SIGKILL)
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
    print(table(rows, title="death of a worker -> its job running again (restarted worker, same name)"))
    path = write_results("recovery", {"rows": rows})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
