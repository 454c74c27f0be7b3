"""Model-selection batches: Sharded-LRTF against FIFO and round-robin, simulated and for real.

    .venv/bin/python -m bench.selection            # default run, about 2-3 minutes on 2 cores
    .venv/bin/python -m bench.selection --quick    # smaller, for a smoke check

1. Discrete-event simulation (trainer/selection/simulate.py) over heterogeneous batches of 8-64
   trials on 1-8 devices: makespan of each policy over the lower bound max(work / devices, longest
   trial), mean and worst over random batches, and how often LRTF is at least as good as the best of
   the others.
2. A real batch of 8 small GPT trials (depth, width and length differ) on 2 CPU "devices" (worker
   threads, one torch thread each): the shard-alternation executor against one trial at a time
   (the same executor with the sequential policy on one device), run interleaved a few times (the
   machine is shared); with --loop-baseline also trainer/loop.py trial after trial on both cores.
   A "ceiling" row measures, at the same moment, what two threads of plain matmuls gain over one.
3. Orchestration overhead per trial, in the real batch and in 4 trials of ~10 s of compute each:
   device-thread time on a trial's behalf that is neither compute (including data and evaluation)
   nor copying, over the trial's total.

4. `--gpu` (alone, on a CUDA machine; bench/results/selection_gpu.json): 4 GPT trials, each larger
   than the device budget, on one GPU: shard alternation (Sharded-LRTF) with the copy stream's
   prefetch on and off, against one trial at a time (sequential policy) with prefetch on; and the
   same trials resident one after another without a budget (the floor when everything fits).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import threading
import time
from typing import Any

import torch

from bench.common import table, write_results
from jobrules.spec import JobSpec
from trainer.config import load_job
from trainer.protocol import NullSink
from trainer.selection.executor import Executor, ExecutorConfig, TrialEntry
from trainer.selection.policy import make_policy
from trainer.selection.simulate import lower_bound, random_batch, simulate
from trainer.selection.space import expand

POLICIES = ["shard-lrtf", "fifo", "round-robin"]


def simulation(*, sizes: list[int], devices: list[int], seeds: int) -> list[dict[str, Any]]:
    rows = []
    for n in sizes:
        for d in devices:
            ratios: dict[str, list[float]] = {p: [] for p in POLICIES}
            lrtf_best = 0
            for seed in range(seeds):
                trials = random_batch(
                    random.Random(1000 * n + 10 * d + seed), trials=n, max_shards=4, max_steps=20
                )
                bound = lower_bound(trials, devices=d)
                spans = {
                    p: simulate(trials, budgets=[None] * d, policy=make_policy(p)).makespan for p in POLICIES
                }
                for p in POLICIES:
                    ratios[p].append(spans[p] / bound)
                lrtf_best += spans["shard-lrtf"] <= min(spans["fifo"], spans["round-robin"]) + 1e-9
            rows.append(
                {
                    "trials": n,
                    "devices": d,
                    "lrtf/bound mean": statistics.mean(ratios["shard-lrtf"]),
                    "lrtf/bound max": max(ratios["shard-lrtf"]),
                    "fifo/bound mean": statistics.mean(ratios["fifo"]),
                    "fifo/bound max": max(ratios["fifo"]),
                    "rr/bound mean": statistics.mean(ratios["round-robin"]),
                    "rr/bound max": max(ratios["round-robin"]),
                    "lrtf <= others": f"{lrtf_best}/{seeds}",
                }
            )
    return rows


def real_batch(*, n_trials: int, scale: float) -> list[JobSpec]:
    base = {
        "model": {"kind": "gpt", "heads": 4, "seq_len": 64},
        "data": {"max_chars": 1_000_000},
        "train": {"batch_size": 16, "optimizer": "adamw", "eval_every": 10_000, "eval_batches": 2},
        # cut every trial into shards (one per two layers), so alternation happens at shard level
        "parallel": {"spill": {"device_budget_mb": 4096, "cuts": [2]}},
    }
    space = {
        "train.lr": {"low": 1e-4, "high": 3e-3, "log": True},
        "model.layers": [2, 3, 4],
        "model.d_model": [64, 96, 128],
        "train.steps": {"low": int(12 * scale), "high": int(40 * scale)},
        "train.seed": [0, 1, 2, 3],
    }
    plans = expand(base=base, space=space, method="random", trials=n_trials, seed=7)
    return [load_job(p.spec) for p in plans]


def cpu_s() -> float:
    t = os.times()
    return t.user + t.system


def run_executor(
    jobs: list[JobSpec], *, devices: int, scheduler: str
) -> tuple[float, float, dict[int, dict]]:
    """(wall seconds, cores used on average, per-trial results)."""
    entries = [TrialEntry(index=i, job=j, sink=NullSink()) for i, j in enumerate(jobs)]
    ex = Executor(entries, devices=[torch.device("cpu")] * devices, cfg=ExecutorConfig(scheduler=scheduler))
    t0, c0 = time.perf_counter(), cpu_s()
    results = ex.run()
    wall = time.perf_counter() - t0
    return wall, (cpu_s() - c0) / wall, results


def thread_ceiling(reps: int = 300) -> tuple[float, float]:
    """(speedup, cores used) of two threads of plain matmuls over one: the most any two-device run
    can gain on this machine at this moment (the machine is shared; this is measured beside it)."""
    torch.set_num_threads(1)
    a, w = torch.randn(1024, 128), torch.randn(128, 512)

    def work() -> None:
        for _ in range(reps):
            (a @ w).relu_()

    t0 = time.perf_counter()
    work()
    work()
    t_seq = time.perf_counter() - t0
    threads = [threading.Thread(target=work) for _ in range(2)]
    t0, c0 = time.perf_counter(), cpu_s()
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    t_par = time.perf_counter() - t0
    return t_seq / t_par, (cpu_s() - c0) / t_par


_LOOP = """
import json, os, sys, time, torch
from trainer.config import load_job
from trainer.runner import run
from trainer.protocol import NeverStop, NullSink
torch.set_num_threads(int(sys.argv[1]))
jobs = [load_job(s) for s in json.load(sys.stdin)]
run(jobs[0], sink=NullSink(), stop=NeverStop(), device=torch.device("cpu"))  # warm-up
t0, c0 = time.perf_counter(), sum(os.times()[:2])
for j in jobs:
    run(j, sink=NullSink(), stop=NeverStop(), device=torch.device("cpu"))
wall = time.perf_counter() - t0
print(json.dumps([wall, (sum(os.times()[:2]) - c0) / wall]))
"""


def loop_in_subprocess(jobs: list[JobSpec], *, threads: int) -> tuple[float, float]:
    """(wall seconds, cores used) of trainer/loop.py over the jobs, one after another, in a fresh
    process: intra-op threads set after this process's worker threads ran behave badly (measured
    27 s instead of 3 s in-process), and a real job runs in its own process anyway."""
    out = subprocess.run(
        [sys.executable, "-c", _LOOP, str(threads)],
        input=json.dumps([j.to_dict() for j in jobs]),
        capture_output=True,
        text=True,
        check=True,
    )
    wall, cores = json.loads(out.stdout.strip().splitlines()[-1])
    return wall, cores


CONFIGS = [
    ("one trial at a time (sequential policy, 1 device)", 1, "sequential"),
    ("shard alternation, Sharded-LRTF, 2 devices", 2, "shard-lrtf"),
    ("shard alternation, FIFO, 2 devices", 2, "fifo"),
]


def real(
    *, n_trials: int, scale: float, reps: int, loop_baseline: bool
) -> tuple[list[dict[str, Any]], list[dict[str, Any]], dict[str, Any]]:
    """The configurations run interleaved, `reps` times each: on a shared machine the CPU a run gets
    drifts, and interleaving spreads the drift over all of them. Rows give the fastest and the
    median wall time, and the cores the fastest run got."""
    jobs = real_batch(n_trials=n_trials, scale=scale)
    torch.set_num_threads(1)
    run_executor(jobs[:1], devices=1, scheduler="fifo")  # warm-up: imports, corpus, meta pass
    walls: dict[str, list[tuple[float, float, float]]] = {name: [] for name, _, _ in CONFIGS}
    res: dict[int, dict] = {}
    for _ in range(reps):
        for name, devices, policy in CONFIGS:
            c0 = cpu_s()
            wall, cores, out = run_executor(jobs, devices=devices, scheduler=policy)
            walls[name].append((wall, cores, cpu_s() - c0))
            if policy == "shard-lrtf" and (not res or wall <= min(w for w, _, _ in walls[name])):
                res = out
    base = min(w for w, _, _ in walls[CONFIGS[0][0]])
    base_med = statistics.median(w for w, _, _ in walls[CONFIGS[0][0]])
    rows = []
    for name, _, _ in CONFIGS:
        best = min(walls[name])
        med = statistics.median(w for w, _, _ in walls[name])
        rows.append(
            {
                "run": name,
                "wall_s min": best[0],
                "wall_s median": med,
                "cores used (min run)": best[1],
                "cpu_s (min run)": best[2],
                "speedup (min)": base / best[0],
                "speedup (median)": base_med / med,
            }
        )
    if loop_baseline:
        for threads in (1, 2):
            t_loop, cores = loop_in_subprocess(jobs, threads=threads)
            rows.append(
                {
                    "run": f"trainer/loop.py trial after trial, {threads} thread(s), fresh process (once)",
                    "wall_s min": t_loop,
                    "wall_s median": t_loop,
                    "cores used (min run)": cores,
                    "cpu_s (min run)": cores * t_loop,
                    "speedup (min)": base / t_loop,
                    "speedup (median)": base_med / t_loop,
                }
            )
    ceiling, ceiling_cores = thread_ceiling()
    rows.append(
        {
            "run": "ceiling now: 2 threads of matmuls vs 1",
            "wall_s min": float("nan"),
            "wall_s median": float("nan"),
            "cores used (min run)": ceiling_cores,
            "cpu_s (min run)": float("nan"),
            "speedup (min)": ceiling,
            "speedup (median)": ceiling,
        }
    )
    over = []
    for i, r in res.items():
        total = r["compute_s"] + r["copy_s"] + r["overhead_s"]
        j = jobs[i]
        over.append(
            {
                "trial": i,
                "layers": j.model.layers,
                "d_model": j.model.d_model,
                "steps": j.train.steps,
                "compute_s": r["compute_s"],
                "copy_s": r["copy_s"],
                "overhead_s": r["overhead_s"],
                "overhead %": 100 * r["overhead_s"] / total,
            }
        )
    summary = {
        "speedup_lrtf_min": rows[1]["speedup (min)"],
        "speedup_lrtf_median": rows[1]["speedup (median)"],
        "ceiling_2_threads": ceiling,
        "overhead_pct_mean": statistics.mean(o["overhead %"] for o in over),
        "overhead_pct_max": max(o["overhead %"] for o in over),
        "trial_compute_s_mean": statistics.mean(o["compute_s"] for o in over),
    }
    return rows, over, summary


def long_trials(*, target_s: float, n: int = 4) -> list[dict[str, Any]]:
    """Orchestration overhead of `n` trials of about `target_s` seconds of compute each (the overhead
    goal is stated for 10-second trials), on 2 devices: calibrate the step count, then run."""
    spec = real_batch(n_trials=1, scale=1.0)[0].to_dict()
    spec["model"].update(layers=4, d_model=128)
    spec["train"].update(steps=5)
    probe = load_job(spec)
    _, _, res = run_executor([probe], devices=1, scheduler="fifo")
    per_step = res[0]["compute_s"] / 5
    spec["train"]["steps"] = max(5, round(target_s / per_step))
    jobs = []
    for i in range(n):
        spec["train"]["seed"] = i
        jobs.append(load_job(spec))
    _, _, res = run_executor(jobs, devices=2, scheduler="shard-lrtf")
    rows = []
    for i, r in res.items():
        total = r["compute_s"] + r["copy_s"] + r["overhead_s"]
        rows.append(
            {
                "trial": i,
                "steps": jobs[i].train.steps,
                "compute_s": r["compute_s"],
                "copy_s": r["copy_s"],
                "overhead_s": r["overhead_s"],
                "overhead %": 100 * r["overhead_s"] / total,
            }
        )
    return rows


GPU_BUDGET_MIB = 3072


def gpu_batch() -> list[JobSpec]:
    """4 trials of 200-340 M parameters: each needs more than GPU_BUDGET_MIB resident (fp32 weights,
    gradients and Adam moments alone are 16 bytes a parameter), so each is cut into shards."""
    out = []
    for i, (layers, d_model, lr) in enumerate(
        [(16, 1024, 3e-4), (16, 1024, 1e-4), (24, 1024, 3e-4), (12, 1536, 2e-4)]
    ):
        spec = {
            "name": f"g{i}",
            "model": {"kind": "gpt", "layers": layers, "d_model": d_model, "heads": 16, "seq_len": 256},
            "data": {"max_chars": 2_000_000},
            "train": {"steps": 8, "batch_size": 8, "lr": lr, "eval_every": 10_000, "seed": i},
            "parallel": {"spill": {"device_budget_mb": GPU_BUDGET_MIB}},
            "resources": {"device": "cuda"},
        }
        out.append(load_job(spec))
    return out


def gpu_rows(*, reps: int) -> list[dict[str, Any]]:
    from trainer.models import recipe_for
    from trainer.recipe import meta_layers

    dev = torch.device("cuda", 0)
    jobs = gpu_batch()
    resident = [load_job(_plain_spec(j)) for j in jobs]
    configs = [
        ("one trial at a time (sequential), prefetch on", "sequential", True, jobs),
        ("shard alternation, Sharded-LRTF, prefetch on", "shard-lrtf", True, jobs),
        ("shard alternation, Sharded-LRTF, prefetch off", "shard-lrtf", False, jobs),
        ("resident, no budget, one after another (floor)", "sequential", True, resident),
    ]

    def once(policy: str, prefetch: bool, batch: list[JobSpec], budget: bool) -> tuple[float, dict]:
        entries = [TrialEntry(index=i, job=j, sink=NullSink()) for i, j in enumerate(batch)]
        cfg = ExecutorConfig(
            scheduler=policy,
            prefetch=prefetch,
            checkpoints="none",
            device_budget_bytes=GPU_BUDGET_MIB * 2**20 if budget else None,
        )
        torch.cuda.synchronize(dev)
        t0 = time.perf_counter()
        results = Executor(entries, devices=[dev], cfg=cfg).run()
        torch.cuda.synchronize(dev)
        bad = {i: r for i, r in results.items() if r["status"] != "succeeded"}
        if bad:
            raise RuntimeError(f"trials failed: {bad}")
        return time.perf_counter() - t0, results

    once("sequential", True, jobs[:1], True)  # warm-up: kernels, corpus, allocator
    walls: dict[str, list[float]] = {c[0]: [] for c in configs}
    detail: dict[str, dict] = {}
    for _ in range(reps):
        for name, policy, prefetch, batch in configs:
            wall, res = once(policy, prefetch, batch, batch is jobs)
            walls[name].append(wall)
            detail[name] = res
    base = statistics.median(walls[configs[0][0]])
    rows = []
    for name, _policy, _prefetch, _batch in configs:
        med = statistics.median(walls[name])
        res = detail[name]
        rows.append(
            {
                "run": name,
                "wall_s median": med,
                "wall_s all": [round(w, 3) for w in walls[name]],
                "x sequential": base / med,
                "compute_s": sum(r["compute_s"] for r in res.values()),
                "copy_s": sum(r["copy_s"] for r in res.values()),
                "prefetch_s": sum(r.get("prefetch_s", 0.0) for r in res.values()),
            }
        )
    rows.append(
        {
            "run": "trials (params M)",
            "wall_s median": float("nan"),
            "wall_s all": [
                round(
                    sum(p.numel() for m in meta_layers(recipe_for(j.model)) for p in m.parameters()) / 1e6, 1
                )
                for j in jobs
            ],
            "x sequential": float("nan"),
            "compute_s": float("nan"),
            "copy_s": float("nan"),
            "prefetch_s": float("nan"),
        }
    )
    return rows


def _plain_spec(job: JobSpec) -> dict[str, Any]:
    spec = job.to_dict()
    spec.pop("parallel", None)
    return spec


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--seeds", type=int, default=0, help="random batches per simulated cell")
    ap.add_argument("--scale", type=float, default=0.0, help="multiplies the real trials' step counts")
    ap.add_argument("--reps", type=int, default=0, help="interleaved repetitions of the real runs")
    ap.add_argument(
        "--loop-baseline", action="store_true", help="also time trainer/loop.py trial after trial, 2 threads"
    )
    ap.add_argument("--gpu", action="store_true", help="only the GPU rows (section 4; needs CUDA)")
    args = ap.parse_args()
    if args.gpu:
        if not torch.cuda.is_available():
            raise SystemExit("--gpu needs a CUDA device; this machine has none")
        rows = gpu_rows(reps=args.reps or 2)
        title = (
            f"4 trials larger than a {GPU_BUDGET_MIB} MiB budget on one GPU ({torch.cuda.get_device_name(0)})"
        )
        print(table(rows, title=title))
        print(f"wrote {write_results('selection_gpu', {'budget_mib': GPU_BUDGET_MIB, 'rows': rows})}")
        return
    seeds = args.seeds or (2 if args.quick else 5)
    scale = args.scale or (0.5 if args.quick else 1.0)
    load = os.getloadavg()[0]

    t0 = time.perf_counter()
    sim = simulation(sizes=[8, 16, 32, 64], devices=[1, 2, 4, 8], seeds=seeds)
    sim_s = time.perf_counter() - t0
    print(table(sim, title=f"Simulated makespan over the lower bound ({seeds} random batches per cell)"))
    reps = args.reps or (1 if args.quick else 3)
    rows, over, summary = real(n_trials=8, scale=scale, reps=reps, loop_baseline=args.loop_baseline)
    print(
        table(
            rows,
            title=f"Real batch: 8 GPT trials, {reps} interleaved runs each (load average {load:.1f} at start)",
        )
    )
    print(table(over, title="Orchestration overhead per trial (Sharded-LRTF run)"))
    target = 3.0 if args.quick else 10.0
    longs = long_trials(target_s=target)
    summary["overhead_pct_long_trials_max"] = max(o["overhead %"] for o in longs)
    title = f"Orchestration overhead, 4 trials of ~{target:.0f} s compute each on 2 devices (LRTF)"
    print(table(longs, title=title))
    print(table([summary], title="Summary"))
    print("GPU rows: pending (no GPU on this machine; `--gpu` on a CUDA machine).")
    path = write_results(
        "selection",
        {
            "simulation": sim,
            "simulation_s": sim_s,
            "real": rows,
            "overhead": over,
            "overhead_long_trials": longs,
            "summary": summary,
            "load_average_at_start": load,
            "gpu": "pending: no GPU on this machine (`--gpu` writes selection_gpu.json)",
        },
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
