"""What one CPU step of bench.peer's trials is made of, and what a second thread does to it.

    python -m bench.cpu_step [--steps 60] [--reps 3] [--out cpu_step]

The trials: bench.peer's GPT (d_model 64, seq 64, batch 16) at 2 and 4 layers, on the CPU. For each
depth, through the trainer's one entry point (trainer/runner.py `run`, the bare side of
bench.peer):

- where a step's time goes at one torch thread: torch.profiler's self CPU time over `--steps`
  steps, in groups (matrix products, attention, GELU and its gradient, the optimizer step with
  everything it calls, the rest), as shares of the profiled total;
- the wall time of `--steps` steps at one and at two torch threads, interleaved, `--reps` times
  each (medians), and their ratio;
- whether the trial's numbers depend on the thread count: its last training loss and val_loss
  after the same steps at lr 0.03, at one and at two threads.

Writes bench/results/<out>.json with the machine and the load average around the run.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any

import torch

from bench.common import write_results
from bench.peer import base_spec

GROUPS: dict[str, tuple[str, ...]] = {
    "matrix products": ("aten::mm", "aten::addmm", "aten::bmm", "aten::matmul"),
    "attention": ("aten::_scaled_dot_product",),
    "gelu": ("aten::gelu",),
}
"""Op-name prefixes per group; the optimizer is counted by its step's total CPU time."""
OPTIMIZER_PREFIX = "Optimizer.step"


def _spec(layers: int, steps: int, lr: float) -> dict[str, Any]:
    spec = base_spec(steps)
    spec["model"]["layers"] = layers
    spec["train"]["lr"] = lr
    spec["train"]["eval_every"] = steps  # one evaluation, at the end
    return spec


def _run(layers: int, steps: int, *, threads: int, lr: float = 1e-3) -> tuple[float, dict[str, Any]]:
    from trainer.config import load_job
    from trainer.protocol import NeverStop, NullSink
    from trainer.runner import run

    torch.set_num_threads(threads)
    job = load_job(_spec(layers, steps, lr))
    t0 = time.perf_counter()
    res = run(job, sink=NullSink(), stop=NeverStop(), device=torch.device("cpu"))
    return time.perf_counter() - t0, res


def profile(layers: int, steps: int) -> dict[str, Any]:
    """Shares of the profiled self CPU time at one thread, by group."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    _run(layers, 3, threads=1)  # warm
    with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
        _run(layers, steps, threads=1)
    events = prof.key_averages()
    total = sum(e.self_cpu_time_total for e in events)
    shares: dict[str, float] = {}
    counted = 0.0
    for name, prefixes in GROUPS.items():
        t = sum(e.self_cpu_time_total for e in events if e.key.startswith(prefixes))
        shares[name] = t / total
        counted += t
    opt = sum(e.cpu_time_total for e in events if e.key.startswith(OPTIMIZER_PREFIX))
    shares["optimizer step"] = opt / total
    shares["the rest"] = max(0.0, 1 - (counted + opt) / total)
    return {"self_cpu_ms_per_step": total / 1e3 / steps, "shares": shares}


def threads(layers: int, steps: int, reps: int) -> dict[str, Any]:
    walls: dict[int, list[float]] = {1: [], 2: []}
    for _ in range(reps):
        for n in (1, 2):
            walls[n].append(_run(layers, steps, threads=n)[0])
    _, one = _run(layers, steps, threads=1, lr=0.03)
    _, two = _run(layers, steps, threads=2, lr=0.03)
    med = {n: statistics.median(w) for n, w in walls.items()}
    return {
        "wall_s": {str(n): w for n, w in walls.items()},
        "wall_median_s": {str(n): m for n, m in med.items()},
        "one / two threads": med[1] / med[2],
        "at lr 0.03": {
            "final_loss": {"1": one["final_loss"], "2": two["final_loss"]},
            "val_loss": {"1": one["val_loss"], "2": two["val_loss"]},
            "equal": one["final_loss"] == two["final_loss"] and one["val_loss"] == two["val_loss"],
        },
    }


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.cpu_step", description=__doc__)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", default="cpu_step")
    args = ap.parse_args()
    load_before = os.getloadavg()[0]
    rows = []
    for layers in (2, 4):
        p = profile(layers, args.steps)
        t = threads(layers, args.steps, args.reps)
        rows.append({"layers": layers, **p, **t})
        shares = ", ".join(f"{k} {v:.0%}" for k, v in p["shares"].items())
        lr = t["at lr 0.03"]
        print(
            f"{layers} layers: {p['self_cpu_ms_per_step']:.1f} ms a step at one thread ({shares}); "
            f"{args.steps} steps {t['wall_median_s']['1']:.2f} s at one thread, "
            f"{t['wall_median_s']['2']:.2f} s at two ({t['one / two threads']:.2f}x); at lr 0.03 "
            f"val_loss {lr['val_loss']['1']:.6f} (one) vs {lr['val_loss']['2']:.6f} (two), "
            f"equal: {lr['equal']}",
            flush=True,
        )
    path = write_results(
        args.out,
        {
            "model": {k: v for k, v in base_spec(args.steps)["model"].items() if k != "layers"},
            "batch_size": base_spec(args.steps)["train"]["batch_size"],
            "steps": args.steps,
            "reps": args.reps,
            "rows": rows,
            "load_average_1min_before_after": [load_before, os.getloadavg()[0]],
        },
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
