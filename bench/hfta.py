"""Horizontal fusion (HFTA, trainer/selection/fused.py): one fused step of K trials against the K
separate steps the same trials take alone.

    python -m bench.hfta [--device cuda] [--members 4] [--steps 30] [--sizes small,medium,large]

For each model size, K AdamW trials of one GPT that differ in lr, weight decay, gradient clipping
and seed are trained `--steps` steps twice from the same start: fused (one `FusedTrials` step per
step) and separately (each trial's own composed engine, `trainer.runner.build_engine`, the engine
a single-trial run uses; its K steps one after another). A step is timed as a trial runs it: its
batches drawn and copied in, forward, backward, optimizer step, losses read back (a sync point in
both paths); the two paths' steps are interleaved, so load from elsewhere falls on both alike.
Reported: the median over the steps after `WARMUP` of the fused step and of the sum of the K
separate steps, their ratio, and the largest absolute difference between a member's fused loss
and its separate loss over every step (fp32). Every member's losses must agree at every step by
torch.testing.assert_close's rule with atol = rtol = 1e-5 (the test's), else the exit code is 1
after the results are written. The rule is relative as well as absolute because the fused kernels
(batched matmuls, a layer norm's affine applied apart) round differently from the separate ones
and training carries the differences forward: on this repo's CPU, 4 layers d_model 256 reached an
absolute difference of 1.2e-5 on a loss near 4.8 within 10 steps (2.5 parts per million).

Sizes (seq_len 128, batch 8): small = 2 layers d_model 128, medium = 4 layers d_model 256, large =
8 layers d_model 512 (CUDA only by default: on a CPU core it takes seconds a step). Writes
bench/results/hfta_<device>.json with the machine. Asked for CUDA without one, exits 2.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

from bench.common import machine, table, write_results
from jobrules.spec import JobSpec
from trainer.config import load_job
from trainer.data import BatchStream, data_for, with_data_vocab
from trainer.models import build_model, count_params
from trainer.protocol import NullSink
from trainer.runner import build_engine
from trainer.selection.fused import FusedTrials

SIZES: dict[str, dict[str, Any]] = {
    "small": {"layers": 2, "d_model": 128, "heads": 4},
    "medium": {"layers": 4, "d_model": 256, "heads": 8},
    "large": {"layers": 8, "d_model": 512, "heads": 8},
}
SEQ_LEN, BATCH = 128, 8
WARMUP = 3
"""Steps left out of the medians (allocator, cuBLAS handles and kernel choice settle in them)."""
ATOL = RTOL = 1e-5
"""Fused and separate losses agree when |fused - separate| <= ATOL + RTOL * |separate| at every
step: torch.testing.assert_close's rule with the tolerances of tests/trainer/test_fused.py."""


def trials(size: str, *, members: int, steps: int, device: str) -> list[JobSpec]:
    out = []
    for k in range(members):
        train = {
            "steps": steps,
            "batch_size": BATCH,
            "optimizer": "adamw",
            "lr": 1e-4 * (1 + k),
            "weight_decay": 0.1 * (k % 2),
            "grad_clip": 1.0 if k % 3 == 2 else 0.0,
            "seed": k,
        }
        spec = {
            "name": f"hfta-{size}-{k}",
            "model": {"kind": "gpt", "seq_len": SEQ_LEN, **SIZES[size]},
            "data": {"max_chars": 400_000},
            "train": train,
            "resources": {"device": device},
        }
        out.append(with_data_vocab(load_job(spec)))
    return out


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


class Separate:
    """The same trials, each on its own composed engine: K steps one after another."""

    def __init__(self, jobs: list[JobSpec], *, dev: torch.device) -> None:
        self.engines = []
        for job in jobs:
            engine, recipe, _ = build_engine(job, sink=NullSink(), device=dev)
            stream = BatchStream(data=data_for(job), batch_size=job.train.batch_size, seed=job.train.seed)
            self.engines.append((engine, recipe, stream))
        self.step = 0

    def train_step(self) -> list[float]:
        losses = []
        for engine, recipe, stream in self.engines:
            x, y = recipe.feed(stream.batch_for(self.step))
            losses.append(engine.train_step(x, y))  # a float: the loss read back, as the loop does
        self.step += 1
        return losses

    def close(self) -> None:
        for engine, _, _ in self.engines:
            engine.close()


def _timed(fn: Callable[[], list[float]], dev: torch.device) -> tuple[float, list[float]]:
    _sync(dev)
    t0 = time.perf_counter()
    losses = fn()  # both paths read their losses back: the step's end
    return time.perf_counter() - t0, losses


def measure(size: str, *, members: int, steps: int, dev: torch.device) -> dict[str, Any]:
    """Both paths side by side, their steps interleaved (fused, separate, fused, ...), so that
    whatever else loads the machine falls on both alike."""
    jobs = trials(size, members=members, steps=steps, device=dev.type)
    fused = FusedTrials(jobs, device=dev)
    separate = Separate(jobs, dev=dev)
    fused_t, sep_t, diffs, within = [], [], [], True
    for _ in range(steps):
        t, fl = _timed(fused.train_step, dev)
        fused_t.append(t)
        t, sl = _timed(separate.train_step, dev)
        sep_t.append(t)
        diffs.append(max(abs(a - b) for a, b in zip(fl, sl, strict=True)))
        # torch.testing.assert_close's rule, as tests/trainer/test_fused.py applies it
        within = within and all(abs(a - b) <= ATOL + RTOL * abs(b) for a, b in zip(fl, sl, strict=True))
    separate.close()
    fused_ms = statistics.median(fused_t[WARMUP:]) * 1e3
    sep_ms = statistics.median(sep_t[WARMUP:]) * 1e3
    cfg = jobs[0].model
    return {
        "model": f"gpt L{cfg.layers} d{cfg.d_model} T{cfg.seq_len} B{BATCH}",
        "params_per_member": count_params(build_model(cfg, seed=0)),
        "members": members,
        "fused_step_ms": fused_ms,
        "separate_steps_ms": sep_ms,
        "separate / fused": sep_ms / fused_ms,
        "max_abs_loss_diff": max(diffs),
        "within_tolerance": within,
        "abs_loss_diff_per_step": diffs,
        "final_losses": fl,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.hfta", description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--members", type=int, default=4, help="K: trials per fused stack")
    ap.add_argument("--steps", type=int, default=30, help=f"steps per run (the first {WARMUP} are not timed)")
    ap.add_argument(
        "--sizes",
        default=None,
        help="comma-separated of small,medium,large (default: small,medium on cpu, all three on cuda)",
    )
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("bench.hfta: --device cuda asked, but this machine has no CUDA device", file=sys.stderr)
        return 2
    if args.steps <= WARMUP:
        ap.error(f"--steps must be more than the {WARMUP} warm-up steps")
    if args.members < 1:
        ap.error("--members must be at least 1")
    sizes = (args.sizes or ("small,medium,large" if args.device == "cuda" else "small,medium")).split(",")
    unknown = [s for s in sizes if s not in SIZES]
    if unknown:
        ap.error(f"--sizes: unknown {unknown}; choose from {sorted(SIZES)}")
    dev = torch.device("cuda", torch.cuda.current_device()) if args.device == "cuda" else torch.device("cpu")
    rows = []
    load_before = os.getloadavg()
    t0 = time.perf_counter()
    for size in sizes:
        rows.append(measure(size, members=args.members, steps=args.steps, dev=dev))
        print(
            {k: v for k, v in rows[-1].items() if k not in ("final_losses", "abs_loss_diff_per_step")},
            flush=True,
        )
    info = machine()
    where = info.get("gpu") if dev.type == "cuda" else f"{info['cpu']} ({torch.get_num_threads()} threads)"
    shown = [
        {k: v for k, v in r.items() if k not in ("final_losses", "abs_loss_diff_per_step")} for r in rows
    ]
    print(
        table(
            shown,
            title=f"HFTA: {args.members} trials fused vs separate on {where}, median of "
            f"{args.steps - WARMUP} steps (fp32)",
        )
    )
    within = all(r["within_tolerance"] for r in rows)
    path = write_results(
        f"hfta_{dev.type}",
        {
            "device": str(dev),
            "members": args.members,
            "steps": args.steps,
            "warmup": WARMUP,
            "torch_threads": torch.get_num_threads(),
            "load_avg_1m_before_after": [load_before[0], os.getloadavg()[0]],
            "method": "median wall time per step after warm-up, synchronised, the two paths' steps "
            "interleaved; separate = the K trials' own composed-engine steps one after another; losses "
            "compared member by member at every step",
            "tolerance": {"atol": ATOL, "rtol": RTOL},
            "losses_within_tolerance": within,
            "elapsed_s": time.perf_counter() - t0,
            "rows": rows,
        },
    )
    print(f"wrote {path} in {time.perf_counter() - t0:.1f} s")
    if not within:
        print(
            f"bench.hfta: fused and separate losses differ by more than {ATOL} + {RTOL} x |loss|",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
