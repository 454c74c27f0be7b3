"""Data-parallel scaling on this machine: the same GPT job's training step as one process and as
dp=2 replicas on real gloo ranks, through the composed engine every job uses (trainer/runner.py's
build_engine, then engine.train_step on BatchStream's batches, as trainer/loop.py runs it).

    .venv/bin/python -m bench.data_parallel [--steps 10]

Two measures per configuration, each the median over the timed steps (after 2 warm-up steps):
- wall: seconds per step (the slowest rank), hence tokens/s. On a shared, loaded machine this mostly
  measures the scheduler: two processes get two shares of the CPU.
- CPU: CPU-seconds per step of all ranks together (time.process_time, every thread of a rank,
  gloo's included), hence tokens per CPU-second: the work replication costs, independent of load.
  Times the cores the run can use, it is the idle-machine ceiling.

The ceiling, said plainly: this container has 2 cores. dp=1 may use both through intra-op threads;
dp=2 runs one thread per replica plus a gradient all-reduce per step. So dp=2 can at best match
dp=1 with 2 threads here; real scaling needs a device per replica.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any

from bench.common import table, write_results

SPEC: dict[str, Any] = {
    "name": "bench-dp",
    "model": {"kind": "gpt", "layers": 4, "d_model": 128, "heads": 4, "seq_len": 64},
    "data": {"max_chars": 400_000},
    "train": {"steps": 100, "batch_size": 16, "lr": 3e-4},
    "resources": {"device": "cpu"},
}
TOKENS = 16 * 64


def _steps(rank: int, world: int, dp: int, threads: int, steps: int) -> dict[str, list[float]]:
    import torch

    from trainer.config import load_job
    from trainer.data import BatchStream, data_for, with_data_vocab
    from trainer.protocol import ListSink
    from trainer.runner import build_engine

    torch.set_num_threads(threads)
    job = with_data_vocab(load_job({**SPEC, "parallel": {"data_parallel": dp}}))
    engine, recipe, _ = build_engine(job, sink=ListSink())
    stream = BatchStream(data=data_for(job), batch_size=job.train.batch_size, seed=job.train.seed)
    wall, cpu, losses = [], [], []
    for k in range(steps + 2):
        x, y = recipe.feed(stream.batch_for(k))
        t0, c0 = time.perf_counter(), time.process_time()
        losses.append(engine.train_step(x, y))
        if k >= 2:
            wall.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
    return {"wall": wall, "cpu": cpu, "loss": losses}


def measure(*, dp: int, threads: int, steps: int) -> dict[str, Any]:
    if dp == 1:
        ranks = [_steps(0, 1, 1, threads, steps)]
    else:
        from tests.gloo import run_ranks

        ranks = run_ranks(_steps, world_size=dp, args=(dp, threads, steps), timeout_s=1200)
    wall = statistics.median(max(r["wall"][i] for r in ranks) for i in range(steps))
    cpu = statistics.median(sum(r["cpu"][i] for r in ranks) for i in range(steps))
    return {
        "dp": dp,
        "threads_per_rank": threads,
        "wall_step_ms": round(wall * 1e3, 1),
        "wall_tokens_per_s": round(TOKENS / wall),
        "cpu_ms_per_step": round(cpu * 1e3, 1),
        "tokens_per_cpu_s": round(TOKENS / cpu),
        "last_loss": round(ranks[0]["loss"][-1], 4),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--steps", type=int, default=10)
    args = ap.parse_args()
    load_before = os.getloadavg()
    rows = [
        measure(dp=1, threads=1, steps=args.steps),
        measure(dp=1, threads=2, steps=args.steps),
        measure(dp=2, threads=1, steps=args.steps),
    ]
    load_after = os.getloadavg()
    base = rows[0]
    cores = os.cpu_count() or 1
    for r in rows:
        r["wall_vs_dp1"] = round(r["wall_tokens_per_s"] / base["wall_tokens_per_s"], 2)
        r["work_efficiency_vs_dp1"] = round(r["tokens_per_cpu_s"] / base["tokens_per_cpu_s"], 2)
        # an idle machine lends the run min(cores, ranks x threads) cores
        r["idle_ceiling_tokens_per_s"] = r["tokens_per_cpu_s"] * min(cores, r["dp"] * r["threads_per_rank"])
    print(table(rows, title=f"data parallel on {cores} cores (GPT 4x128, batch 16 x 64 tokens per step)"))
    print(f"load average before {load_before[0]:.1f}, after {load_after[0]:.1f} (the machine is shared)")
    path = write_results(
        "data_parallel",
        {
            "rows": rows,
            "steps": args.steps,
            "load_average_before": load_before,
            "load_average_after": load_after,
            "note": (
                "2 cores: dp=2 runs one thread per replica; dp=1 with 2 threads is the fair upper bound. "
                "Wall numbers on a shared machine measure scheduler shares; tokens per CPU-second measure "
                "the work replication costs."
            ),
        },
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
