"""chimera-zb's split backward on a GPU: time of B (input gradient) + W (weight gradients) against
one plain backward of the same pipeline stage, with real kernels.

    python -m bench.split_gpu [--steps 30]

Each timed op goes through the driver's own compute path (trainer/pipeline/driver.py
`_StepRun.compute`, no processes: a compute sends nothing), on a middle stage of a GPT at D=4, so
the stage has an input gradient to return. Plain = chimera's B; split = chimera-zb's B then W.
Timed with CUDA events around each op after warm-up, median over `--steps`; FLOPs from
FlopCounterMode beside the times. Needs CUDA; writes bench/results/split_gpu.json.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from typing import Any

import torch
from torch.utils.flop_counter import FlopCounterMode

from bench.common import machine, table, write_results
from jobrules.spec import ModelSpec
from trainer.models import build_model
from trainer.pipeline.driver import PipelineDriver, _StepRun
from trainer.pipeline.schedules import Action, build_schedule
from trainer.pipeline.stage import build_stages

D, N = 4, 4
STAGE = 1


def _timed(fn: Any, dev: torch.device) -> float:
    if dev.type != "cuda":  # the --device cpu dry run: wall time
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def _flops(fn: Any) -> int:
    with FlopCounterMode(display=False) as counter:
        fn()
    return counter.get_total_flops()


def measure(
    schedule: str, cfg: ModelSpec, *, micro: int, steps: int, dtype: torch.dtype, dev: torch.device
) -> dict[str, Any]:
    sched = build_schedule(schedule, stages=D, microbatches=N)
    model = build_model(cfg, seed=0).to(dev, dtype)
    modules = build_stages(model, sched=sched, rank=STAGE)
    ex = PipelineDriver(
        sched=sched,
        rank=STAGE,
        modules=modules,
        act_shape=(micro, cfg.seq_len, cfg.d_model),
        act_dtype=dtype,
        device=dev,
    )
    g = torch.Generator(device=dev).manual_seed(0)
    x = torch.randint(0, cfg.vocab_size, (micro * N, cfg.seq_len), generator=g, device=dev)
    shape = (micro, cfg.seq_len, cfg.d_model)
    times: dict[str, list[float]] = {"F": [], "B": [], "W": []}
    flops: dict[str, int] = {}
    for i in range(steps + 3):
        run = _StepRun(ex, xs=x.chunk(N), ys=x.chunk(N), t0=0.0)
        act = torch.randn(shape, generator=g, device=dev, dtype=dtype)
        grad = torch.randn(shape, generator=g, device=dev, dtype=dtype)
        inputs = {"F": act, "B": grad, "W": None}
        names = ["F", "B", "W"] if sched.split_backward else ["F", "B"]
        ops = [(n, functools.partial(run.compute, Action(n, 0, STAGE), inputs[n])) for n in names]
        for name, fn in ops:
            if i == 0:
                flops[name] = _flops(fn)
            elif i >= 3:  # two warm-up rounds after the counted one
                times[name].append(_timed(fn, dev))
            else:
                fn()
        for mod in modules.values():
            for p in mod.parameters():
                p.grad = None
    return {k: statistics.median(v) for k, v in times.items() if v} | {"flops": flops}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.split_gpu")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--device", default="cuda", help="cpu: a tiny dry run of the code path (no results file)")
    args = ap.parse_args(argv)
    dev = torch.device(args.device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("bench.split_gpu needs a CUDA device; this machine has none")
    rows = []
    shapes = [
        (
            "gpt L16 d1024 T512 mb4",
            ModelSpec(kind="gpt", layers=16, d_model=1024, heads=16, seq_len=512, vocab_size=256),
            4,
        ),
        (
            "gpt L16 d2048 T512 mb4",
            ModelSpec(kind="gpt", layers=16, d_model=2048, heads=16, seq_len=512, vocab_size=256),
            4,
        ),
    ]
    if dev.type == "cpu":
        shapes = [
            (
                "gpt L8 d64 T32 mb2",
                ModelSpec(kind="gpt", layers=8, d_model=64, heads=4, seq_len=32, vocab_size=256),
                2,
            )
        ]
    for label, cfg, micro in shapes:
        for dtype in (torch.float32, torch.bfloat16):
            plain = measure("chimera", cfg, micro=micro, steps=args.steps, dtype=dtype, dev=dev)
            split = measure("chimera-zb", cfg, micro=micro, steps=args.steps, dtype=dtype, dev=dev)
            bw = split["B"] + split["W"]
            rows.append(
                {
                    "stage": f"{label} stage {STAGE}/{D}",
                    "dtype": str(dtype).removeprefix("torch."),
                    "forward_ms": plain["F"],
                    "plain_backward_ms": plain["B"],
                    "split_B_ms": split["B"],
                    "split_W_ms": split["W"],
                    "B+W / plain (time)": bw / plain["B"],
                    "B+W / plain (flops)": (split["flops"]["B"] + split["flops"]["W"]) / plain["flops"]["B"],
                    "backward / forward": plain["B"] / plain["F"],
                }
            )
            print(table(rows[-1:]), flush=True)
    print(table(rows, title=f"Split backward on {machine().get('gpu')} (medians of {args.steps})"))
    if dev.type == "cpu":
        return
    path = write_results(
        "split_gpu",
        {
            "rows": rows,
            "method": "driver _StepRun.compute per op, CUDA events, median; stage 1 of D=4, one micro-batch",
        },
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
