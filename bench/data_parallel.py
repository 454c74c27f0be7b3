"""Data-parallel scaling on this machine: the same GPT job as one process and as dp=2 replicas
(`python -m trainer` under torchrun with gloo), tokens/s from the per-step times the trainer itself
reports (median over the steps after warm-up; evaluation excluded).

    .venv/bin/python -m bench.data_parallel [--steps 12]

The ceiling, said plainly: this container has 2 cores. dp=1 may use both through intra-op threads;
dp=2 runs one thread per replica plus a gradient all-reduce per step. So dp=2 can at best match
dp=1 with 2 threads here; the row that shows replication itself is dp=2 against dp=1 with ONE
thread (equal threads per replica). Real scaling needs a device per replica.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench.common import machine, table, write_results

ROOT = Path(__file__).resolve().parents[1]


def job(steps: int, dp: int) -> dict[str, Any]:
    return {
        "name": f"bench-dp{dp}",
        "model": {"kind": "gpt", "layers": 4, "d_model": 128, "heads": 4, "seq_len": 64},
        "data": {"max_chars": 400_000},
        "train": {"steps": steps, "batch_size": 16, "lr": 3e-4, "eval_every": steps, "eval_batches": 1},
        "parallel": {"data_parallel": dp},
        "resources": {"device": "cpu"},
    }


def run(*, dp: int, threads: int, steps: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        spec = Path(tmp) / "spec.json"
        spec.write_text(json.dumps(job(steps, dp)))
        env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": str(threads)}
        if dp == 1:
            cmd = [sys.executable, "-m", "trainer", "--spec", str(spec)]
        else:
            cmd = [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--standalone",
                f"--nproc-per-node={dp}",
                "-m",
                "trainer",
                "--spec",
                str(spec),
            ]
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=1200)
    lines = [json.loads(x) for x in proc.stdout.splitlines() if x.startswith("{")]
    if proc.returncode != 0:
        raise RuntimeError(f"dp={dp} failed: {proc.stderr[-2000:]}")
    step_ms = [x["value"] for x in lines if x["kind"] == "metric" and x["name"] == "step_time_ms"]
    (result,) = [x["data"] for x in lines if x["kind"] == "result"]
    tokens = 16 * 64
    warm = step_ms[2:]  # the first steps pay allocator and thread-pool start-up
    median_ms = statistics.median(warm)
    return {
        "dp": dp,
        "threads_per_rank": threads,
        "step_ms_median": round(median_ms, 1),
        "tokens_per_s": round(tokens / (median_ms / 1e3)),
        "final_loss": round(result["final_loss"], 4),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--steps", type=int, default=12)
    args = ap.parse_args()
    load_before = os.getloadavg()
    rows = [
        run(dp=1, threads=1, steps=args.steps),
        run(dp=1, threads=2, steps=args.steps),
        run(dp=2, threads=1, steps=args.steps),
    ]
    load_after = os.getloadavg()
    base1, base2 = rows[0]["tokens_per_s"], rows[1]["tokens_per_s"]
    for r in rows:
        r["vs_dp1_1thread"] = round(r["tokens_per_s"] / base1, 2)
        r["vs_dp1_2threads"] = round(r["tokens_per_s"] / base2, 2)
    print(table(rows, title=f"data parallel on {os.cpu_count()} cores (GPT 4x128, batch 16 x 64 tokens)"))
    print(f"load average before {load_before[0]:.1f}, after {load_after[0]:.1f} (the machine is shared)")
    path = write_results(
        "data_parallel",
        {
            "rows": rows,
            "steps": args.steps,
            "load_average_before": load_before,
            "load_average_after": load_after,
            "note": "2-core ceiling: dp=2 runs one thread per replica; dp=1 with 2 threads is the fair upper bound",
            "machine_detail": machine(),
        },
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
