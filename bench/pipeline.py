"""Pipeline schedules: simulated bubbles and memory, jitter, a real 4-rank gloo run, a 1.3B projection.

    .venv/bin/python -m bench.pipeline            # everything (~2-3 min on a 2-core machine)
    .venv/bin/python -m bench.pipeline --quick    # skip the real gloo run

Sections:
1. simulated bubble ratio and peak stashed activations for every schedule at D in {4,8,16,32},
   N in {D,2D,4D}, backward = 1x and 2x forward (unit forward cost, zero transfer);
2. message-driven (`async`) vs static 1F1B makespan under +/-30% per-action compute jitter;
3. a real D=4 gloo run of the pipeline job (trainer.runner.run) per schedule: bubble measured from the executed
   timelines, beside the simulation fed with the costs measured in that run, and step time;
4. a GPT-2 1.3B-shaped projection at 8-2048 devices from per-layer costs measured on this CPU;
5. our gpipe / 1f1b driver against torch.distributed.pipelining's ScheduleGPipe / Schedule1F1B,
   same model, split, micro-batches and data, gloo D=2 and D=4, interleaved in one run;
6. executed 1f1b / chimera / chimera-zb steps at backward = 2x forward (sleeps stand in for
   compute, so the schedule and its messages are what is measured), and the same three with the
   GPT of section 5 computing for real (what chimera-zb's split backward really costs).

    .venv/bin/python -m bench.pipeline --executed-only   # sections 5 and 6 only
    .venv/bin/python -m bench.pipeline --split-only      # section 6 only

Sections 1-4 write bench/results/pipeline.json, 5 pipeline-executed.json, 6 pipeline-split.json.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from bench.common import machine, table, write_results
from trainer.pipeline.schedules import LATENCY_PROBE, SCHEDULES, build_schedule
from trainer.pipeline.simulate import Costs, bubble_1f1b, bubble_chimera, jitter, simulate


def simulated_rows() -> list[dict[str, Any]]:
    rows = []
    for D in (4, 8, 16, 32):
        for N in (D, 2 * D, 4 * D):
            for bwd in (1.0, 2.0):
                row: dict[str, Any] = {"D": D, "N": N, "bwd/fwd": bwd}
                for name in SCHEDULES:
                    # chimera and chimera-zb orders are built for the ratio they are timed at
                    sched = build_schedule(name, stages=D, microbatches=N, backward_ratio=bwd)
                    res = simulate(sched, Costs(forward=1.0, backward=bwd))
                    row[f"bubble {name}"] = round(res.bubble, 4)
                    row[f"stash {name}"] = f"{min(res.peak_stash)}-{max(res.peak_stash)}"
                row["1f1b formula"] = round(bubble_1f1b(D, N), 4)
                row["chimera formula"] = round(bubble_chimera(D, N), 4)
                rows.append(row)
    return rows


def jitter_rows(*, seeds: int = 20, spread: float = 0.3) -> list[dict[str, Any]]:
    """Both runs see the same cost draw per action; async at two in-flight caps."""
    rows = []
    for D in (4, 8, 16):
        for N in (D, 2 * D, 4 * D):
            static = build_schedule("1f1b", stages=D, microbatches=N)
            dynamic = build_schedule("async", stages=D, microbatches=N)
            row: dict[str, Any] = {"D": D, "N": N}
            for cap, label in ((D, "cap D"), (2 * D, "cap 2D")):
                ratios, wins, stash = [], 0, 0
                for seed in range(seeds):
                    noise = jitter(static, spread=spread, seed=seed)
                    ms = simulate(static, Costs(backward=2.0), noise=noise).makespan
                    res = simulate(dynamic, Costs(backward=2.0), noise=noise, cap=cap)
                    ratios.append(res.makespan / ms)
                    wins += res.makespan < ms
                    stash = max(stash, max(res.peak_stash))
                row[f"async/1f1b {label}"] = round(statistics.mean(ratios), 4)
                row[f"wins {label}"] = f"{wins}/{seeds}"
                row[f"stash {label}"] = stash
            row["stash 1f1b"] = min(D, N)
            rows.append(row)
    return rows


def _real_rank(rank: int, world: int, schedules: tuple[str, ...], Ns: tuple[int, ...], steps: int) -> dict:
    return {N: _real_one(rank, world, schedules=schedules, microbatches=N, steps=steps) for N in Ns}


def _real_one(rank: int, world: int, *, schedules: tuple[str, ...], microbatches: int, steps: int) -> dict:
    from trainer.config import load_job
    from trainer.protocol import ListSink, NeverStop
    from trainer.runner import run

    out = {}
    for name in schedules:
        spec = {
            "name": f"bench-{name}",
            "model": {"kind": "gpt", "layers": 6, "d_model": 128, "heads": 4, "seq_len": 64},
            "data": {"max_chars": 200_000},
            "train": {"steps": steps, "batch_size": 16, "eval_every": 2, "eval_batches": 1},
            "parallel": {"pipeline": {"stages": world, "microbatches": microbatches, "schedule": name}},
            "resources": {"device": "cpu"},
        }
        sink = ListSink()
        run(load_job(spec), sink=sink, stop=NeverStop())
        if rank == 0:
            events = [d for e, d in sink.events if e == "timeline"][1:]  # the step-2 one is still warming up
            out[name] = {
                "step_ms": sink.series("step_time_ms")[2:],
                "bubble_executed": [e["bubble_executed"] for e in events],
                "bubble_simulated": [e["bubble_simulated"] for e in events],
                "peak_stash_executed": events[-1]["peak_stash_executed"],
                "peak_stash_simulated": events[-1]["peak_stash_simulated"],
            }
    return out


def real_rows(*, steps: int = 10) -> list[dict[str, Any]]:
    """Step time is shown as best-of and median: the machine is shared, and the best step is the
    one least disturbed by other processes. With D=4 the 4 ranks share 2 cores, so a rank's
    compute spans include time it was descheduled; D=2 gives each rank a core."""
    from tests.gloo import run_ranks

    rows = []
    for D, Ns in ((2, (4, 8)), (4, (4, 8))):
        every = run_ranks(_real_rank, world_size=D, args=(SCHEDULES, Ns, steps), timeout_s=600)[0]
        for N in Ns:
            for name in SCHEDULES:
                r = every[N][name]
                rows.append(
                    {
                        "schedule": name,
                        "D": D,
                        "N": N,
                        "step ms best": round(min(r["step_ms"]), 1),
                        "step ms median": round(statistics.median(r["step_ms"]), 1),
                        "bubble executed": round(statistics.median(r["bubble_executed"]), 3),
                        "bubble simulated (measured costs)": round(
                            statistics.median(r["bubble_simulated"]), 3
                        ),
                        "peak stash executed": r["peak_stash_executed"],
                        "peak stash simulated": r["peak_stash_simulated"],
                    }
                )
    return rows


def _jitter_rank(rank: int, world: int, Ns: tuple[int, ...], steps: int, base_s: float) -> dict:
    return {N: _jitter_one(rank, world, N=N, steps=steps, base_s=base_s) for N in Ns}


def _jitter_one(rank: int, world: int, *, N: int, steps: int, base_s: float) -> dict[str, list[float]]:
    """Driver runs where each action's compute is stood in for by a sleep of base_s (F) or
    2 x base_s (B) times a +/-30% draw keyed by (step, action): sleeps leave the 2 cores free,
    so the comparison measures ordering, not CPU contention. Tiny real model underneath."""
    import random

    import torch.distributed as dist

    from jobrules.spec import ModelSpec
    from trainer.models import build_model
    from trainer.pipeline.driver import PipelineDriver
    from trainer.pipeline.simulate import summarize
    from trainer.pipeline.stage import build_stages

    cfg = ModelSpec(layers=2, d_model=32, heads=2, seq_len=16)
    g = torch.Generator().manual_seed(0)
    window = torch.randint(0, cfg.vocab_size or 128, (N, cfg.seq_len + 1), generator=g)
    x, y = window[:, :-1], window[:, 1:]
    out: dict[str, list[float]] = {}
    for name in ("1f1b", "async"):
        sched = build_schedule(name, stages=world, microbatches=N)
        modules = build_stages(build_model(cfg, seed=0), sched=sched, rank=rank)
        spans = []
        # step -1 warms up: the first messages between a pair of ranks set up gloo connections
        for step in range(-1, steps):

            def delay(a: Any, step: int = step) -> float:
                u = random.Random(f"{step}-{a.op}-{a.mb}-{a.stage}").uniform(-0.3, 0.3)
                return base_s * (2.0 if a.op == "B" else 1.0) * (1.0 + u)

            ex = PipelineDriver(
                sched=sched, rank=rank, modules=modules, act_shape=(1, cfg.seq_len, cfg.d_model), delay=delay
            )
            dist.barrier()
            t0 = time.perf_counter()
            rec = ex.step(x, y, t0=t0)
            ex.close()
            tl: list[Any] = [None] * world
            dist.all_gather_object(tl, rec.timeline)
            if step >= 0:
                spans.append(summarize([e for t in tl for e in t], ranks=world, split=False).makespan)
            for m in modules.values():
                m.zero_grad(set_to_none=True)
        out[name] = spans
    return out


def real_jitter_rows(*, steps: int = 6, base_s: float = 0.01) -> list[dict[str, Any]]:
    from tests.gloo import run_ranks

    rows = []
    Ns = (4, 8, 16)
    every = run_ranks(_jitter_rank, world_size=4, args=(Ns, steps, base_s), timeout_s=600)[0]
    for N in Ns:
        res = every[N]
        # median: a step that a neighbour's process stalls should not decide the row
        s, a = statistics.median(res["1f1b"]), statistics.median(res["async"])
        rows.append(
            {
                "D": 4,
                "N": N,
                "1f1b makespan ms (median)": round(s * 1e3, 1),
                "async makespan ms (median)": round(a * 1e3, 1),
                "async/1f1b": round(a / s, 4),
                "async faster (steps)": f"{sum(x < y for x, y in zip(res['async'], res['1f1b'], strict=True))}/{steps}",
            }
        )
    return rows


# ---- against torch.distributed.pipelining, and the split backward executed --------------------
VS_CFG = {"kind": "gpt", "layers": 6, "d_model": 128, "heads": 4, "seq_len": 64, "vocab_size": 128}
VS_BATCH = 16


def _vs_torch_rank(rank: int, world: int, N: int, steps: int) -> dict[str, list[float]]:
    """Our gpipe / 1f1b driver and torch's ScheduleGPipe / Schedule1F1B on the same model, split,
    micro-batches and data, interleaved step by step in one run so load changes hit both."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    from jobrules.spec import ModelSpec
    from trainer.models import build_model, lm_loss
    from trainer.pipeline.driver import PipelineDriver
    from trainer.pipeline.stage import build_stages

    cfg = ModelSpec(**VS_CFG)
    g = torch.Generator().manual_seed(0)
    window = torch.randint(0, cfg.vocab_size, (VS_BATCH, cfg.seq_len + 1), generator=g)
    x, y = window[:, :-1].contiguous(), window[:, 1:].contiguous()
    runners = {}
    for name in ("gpipe", "1f1b"):
        sched = build_schedule(name, stages=world, microbatches=N)
        ours = build_stages(build_model(cfg, seed=0), sched=sched, rank=rank)
        ex = PipelineDriver(
            sched=sched, rank=rank, modules=ours, act_shape=(VS_BATCH // N, cfg.seq_len, cfg.d_model)
        )
        runners[f"ours {name}"] = (lambda ex=ex: ex.step(x, y), ours[(rank, 0)])
        mod = build_stages(build_model(cfg, seed=0), sched=sched, rank=rank)[(rank, 0)]
        stage = PipelineStage(mod, stage_index=rank, num_stages=world, device=torch.device("cpu"))
        kind = ScheduleGPipe if name == "gpipe" else Schedule1F1B
        ts = kind(stage, n_microbatches=N, loss_fn=lm_loss, scale_grads=True)

        def torch_step(ts: Any = ts) -> None:
            if rank == 0:
                ts.step(x)
            elif rank == world - 1:
                ts.step(target=y, losses=[])
            else:
                ts.step()

        runners[f"torch {name}"] = (torch_step, mod)
    return _interleaved(runners, steps=steps)


def vs_torch_rows(*, steps: int = 8) -> list[dict[str, Any]]:
    from tests.gloo import run_ranks

    rows = []
    for D, N in ((2, 4), (2, 8), (4, 4), (4, 8)):
        res = run_ranks(_vs_torch_rank, world_size=D, args=(N, steps), timeout_s=900)[0]
        for name in ("gpipe", "1f1b"):
            o, t = statistics.median(res[f"ours {name}"]), statistics.median(res[f"torch {name}"])
            rows.append(
                {
                    "D": D,
                    "N": N,
                    "schedule": name,
                    "ours ms (median)": round(o * 1e3, 1),
                    "torch ms (median)": round(t * 1e3, 1),
                    "ours/torch": round(o / t, 3),
                }
            )
    return rows


def _split_rank(
    rank: int, world: int, N: int, steps: int, base_s: float, real: bool
) -> dict[str, list[float]]:
    """Executed step time of 1f1b / chimera / chimera-zb, the three interleaved step by step (so a
    load change on the shared machine hits all three). `real`: the GPT 6x128 of section 5 with
    its own compute (the split backward's true cost: B + W against a whole backward). Otherwise
    compute is stood in by sleeps at backward = 2 x forward (chimera-zb: B = W = forward) on a
    tiny real model underneath, so what is measured is the schedule and its messages."""
    from torch import nn

    from jobrules.spec import ModelSpec
    from trainer.models import build_model
    from trainer.pipeline.driver import PipelineDriver
    from trainer.pipeline.stage import build_stages

    cfg = ModelSpec(**VS_CFG) if real else ModelSpec(layers=2, d_model=32, heads=2, seq_len=16)
    batch = VS_BATCH if real else N
    g = torch.Generator().manual_seed(0)
    window = torch.randint(0, cfg.vocab_size or 128, (batch, cfg.seq_len + 1), generator=g)
    x, y = window[:, :-1].contiguous(), window[:, 1:].contiguous()
    runs: dict[str, tuple[Any, Any]] = {}
    for name in ("1f1b", "chimera", "chimera-zb"):
        sched = build_schedule(name, stages=world, microbatches=N, backward_ratio=2.0)
        modules = build_stages(build_model(cfg, seed=0), sched=sched, rank=rank)
        split = sched.split_backward

        def delay(a: Any, split: bool = split) -> float:
            return base_s * (2.0 if a.op == "B" and not split else 1.0)

        ex = PipelineDriver(
            sched=sched,
            rank=rank,
            modules=modules,
            act_shape=(batch // N, cfg.seq_len, cfg.d_model),
            delay=None if real else delay,
        )
        runs[name] = (lambda ex=ex: ex.step(x, y), nn.ModuleList(modules.values()))
    return _interleaved(runs, steps=steps)


def _interleaved(runners: dict[str, tuple[Any, Any]], *, steps: int) -> dict[str, list[float]]:
    """Seconds per step of each runner (a step function and the module whose gradients it fills),
    the runners taking turns step by step so a load change on the shared machine hits them all;
    every rank between barriers. Step 0 warms up (connections, allocator) and is not counted."""
    import torch.distributed as dist

    out: dict[str, list[float]] = {k: [] for k in runners}
    for step in range(steps + 1):
        for key, (fn, mod) in runners.items():
            mod.zero_grad(set_to_none=True)
            dist.barrier()
            t0 = time.perf_counter()
            fn()
            dist.barrier()
            if step:
                out[key].append(time.perf_counter() - t0)
    return out


SPLIT_SHAPES = ((2, 4), (2, 8), (4, 4), (4, 8))


def split_rows(*, real: bool, steps: int = 10, base_s: float = 0.01) -> list[dict[str, Any]]:
    """One row per (D, N): median step ms per schedule; with sleeps also the simulated makespan."""
    from tests.gloo import run_ranks

    rows = []
    for D, N in SPLIT_SHAPES:
        res = run_ranks(_split_rank, world_size=D, args=(N, steps, base_s, real), timeout_s=900)[0]
        med = {k: statistics.median(v) for k, v in res.items()}
        row: dict[str, Any] = {"D": D, "N": N, **{f"{k} ms": round(v * 1e3, 1) for k, v in med.items()}}
        if not real:
            for k in med:
                sched = build_schedule(k, stages=D, microbatches=N, backward_ratio=2.0)
                row[f"{k} sim ms"] = round(simulate(sched, Costs(backward=2.0)).makespan * base_s * 1e3, 1)
            for k in ("chimera", "chimera-zb"):
                # with each message taking a quarter forward (2.5 ms; the executed Chimera D=2
                # steps wait 1-3 ms per hand-off): at D=2 the only place chimera-zb can gain
                sched = build_schedule(k, stages=D, microbatches=N, backward_ratio=2.0)
                lat = Costs(backward=2.0, transfer=LATENCY_PROBE)
                row[f"{k} sim ms lat {LATENCY_PROBE}"] = round(
                    simulate(sched, lat).makespan * base_s * 1e3, 1
                )
        row["chimera-zb/chimera"] = round(med["chimera-zb"] / med["chimera"], 3)
        row["chimera/1f1b"] = round(med["chimera"] / med["1f1b"], 3)
        rows.append(row)
    return rows


# ---- projection -------------------------------------------------------------------------------
# GPT-2 1.3B-shaped: 24 blocks, d_model 2048, 16 heads (12 * 24 * 2048^2 = 1.21e9 block parameters
# plus embeddings ~ 1.3e9). Per-block forward/backward measured on this CPU at one sequence of
# PROJ_T tokens per micro-batch. Everything below the measured block costs is an assumption.
PROJ_LAYERS, PROJ_D, PROJ_HEADS, PROJ_T = 24, 2048, 16, 128
LINK_GBPS, LINK_LATENCY_S = 10.0, 5e-6  # per-link bandwidth (GB/s) and latency
DEVICE_GIB = 16.0  # a P100-sized device (the Chimera paper ran on Piz Daint's P100s)
SEQS_PER_DEVICE = 4  # weak scaling: global batch = 4 x devices sequences, 1 sequence per micro-batch
STATE_BYTES_PER_PARAM = 16  # fp32 weights, gradients and two Adam moments
ACT_BYTES_PER_BLOCK = 34 * PROJ_T * PROJ_D + 5 * PROJ_HEADS * PROJ_T * PROJ_T  # Megatron's estimate, fp16


def measure_block(device: str = "cpu") -> dict[str, float]:
    """One GPT-2 1.3B-shaped block's forward, backward and AdamW step, in seconds: fp32 on the
    CPU, bf16 on a GPU (timed with a synchronize around each op)."""
    from trainer.models import Block

    dev = torch.device(device)
    gpu = dev.type == "cuda"
    dtype = torch.bfloat16 if gpu else torch.float32
    skip = 3 if gpu else 1  # the first runs pay allocation, not counted

    def sync() -> None:
        if gpu:
            torch.cuda.synchronize(dev)

    torch.manual_seed(0)
    block = Block(d_model=PROJ_D, heads=PROJ_HEADS, mlp_ratio=4).to(dev, dtype)
    x = torch.randn(1, PROJ_T, PROJ_D, requires_grad=True, device=dev, dtype=dtype)
    fwd, bwd = [], []
    for i in range(skip + (20 if gpu else 5)):
        sync()
        t0 = time.perf_counter()
        y = block(x)
        sync()
        t1 = time.perf_counter()
        y.sum().backward()
        sync()
        t2 = time.perf_counter()
        if i >= skip:
            fwd.append(t1 - t0)
            bwd.append(t2 - t1)
    # the optimizer step counts too: a Chimera rank updates two stage copies
    opt = torch.optim.AdamW(block.parameters(), lr=1e-4)
    steps = []
    for i in range(skip + (10 if gpu else 3)):
        sync()
        t0 = time.perf_counter()
        opt.step()
        sync()
        if i >= skip:
            steps.append(time.perf_counter() - t0)
    return {
        "forward_s": statistics.median(fwd),
        "backward_s": statistics.median(bwd),
        "adamw_step_s": statistics.median(steps),
    }


def _ring_allreduce_s(nbytes: float, n: int) -> float:
    if n <= 1:
        return 0.0
    return 2 * (n - 1) / n * nbytes / (LINK_GBPS * 1e9) + 2 * (n - 1) * LINK_LATENCY_S


def _project(name: str, *, P: int, D: int, block: dict[str, float]) -> dict[str, Any] | None:
    """Seconds per iteration of scheme `name` at depth D on P devices, or None if it cannot fit
    even with activation recomputation."""
    W = P // D
    N = SEQS_PER_DEVICE * D  # global batch 4P = W replicas x N micro-batches
    per = PROJ_LAYERS / D
    copies = 2 if name == "chimera" else 1
    state = copies * per * 12 * PROJ_D * PROJ_D * STATE_BYTES_PER_PARAM
    for recompute in (False, True):
        fwd = per * block["forward_s"]
        bwd = per * block["backward_s"] + (fwd if recompute else 0.0)
        costs = Costs(
            forward=fwd, backward=bwd, transfer=LINK_LATENCY_S + PROJ_T * PROJ_D * 2 / (LINK_GBPS * 1e9)
        )
        sched = build_schedule(name, stages=D, microbatches=N, backward_ratio=bwd / fwd)
        sim = simulate(sched, costs)
        # recomputation keeps only each stage's input per micro-batch
        act = PROJ_T * PROJ_D * 2 if recompute else per * ACT_BYTES_PER_BLOCK
        if state + max(sim.peak_stash) * act > DEVICE_GIB * 2**30:
            continue
        # each stage copy is synchronised over all its copies: W (x2 for Chimera's replicas)
        sync = copies * _ring_allreduce_s(per * 12 * PROJ_D * PROJ_D * 4, copies * W)
        opt = copies * per * block["adamw_step_s"]
        return {"s": sim.makespan + sync + opt, "D": D, "recompute": recompute, "bubble": sim.bubble}
    return None


def projection_rows(block: dict[str, float]) -> list[dict[str, Any]]:
    rows = []
    for P in (8, 32, 128, 512, 2048):
        best: dict[str, dict[str, Any]] = {}
        for name in ("gpipe", "1f1b", "chimera"):
            for D in (2, 4, 8, 16):
                if P % D or P // D < 1:
                    continue
                got = _project(name, P=P, D=D, block=block)
                if got is not None and (name not in best or got["s"] < best[name]["s"]):
                    best[name] = got
        row: dict[str, Any] = {"devices": P}
        for name in ("gpipe", "1f1b", "chimera"):
            b = best[name]
            row[f"{name} s/iter"] = round(b["s"], 2)
            row[f"{name} D"] = f"{b['D']}{'/rc' if b['recompute'] else ''}"
        row["chimera vs 1f1b"] = round(best["1f1b"]["s"] / best["chimera"]["s"], 3)
        row["chimera vs gpipe"] = round(best["gpipe"]["s"] / best["chimera"]["s"], 3)
        rows.append(row)
    return rows


def timed_section(
    payload: dict[str, Any], key: str, rows: Callable[[], list[dict[str, Any]]], *, title: str
) -> None:
    """One measured section: its rows kept in `payload[key]` and printed under `title`, with the
    seconds the section took."""
    t = time.perf_counter()
    payload[key] = got = rows()
    print(table(got, title=f"{title} ({time.perf_counter() - t:.0f}s)"))


def executed_sections(payload: dict[str, Any]) -> None:
    timed_section(
        payload,
        "vs_torch_pipelining",
        vs_torch_rows,
        title="5. our driver vs torch.distributed.pipelining, same GPT 6x128, batch 16, gloo "
        "(step ms, median of 8, interleaved)",
    )


def split_sections() -> None:
    """Section 6, written to its own results file."""
    payload: dict[str, Any] = {}
    timed_section(
        payload,
        "executed_bwd_2x",
        lambda: split_rows(real=False),
        title="6. executed step, compute stood in by sleeps: F 10 ms, B 20 ms (chimera-zb: B 10 + W 10), "
        "median of 10 interleaved steps",
    )
    timed_section(
        payload,
        "executed_real_compute",
        lambda: split_rows(real=True),
        title="6b. executed step, real compute: GPT 6x128, batch 16, seq 64 "
        "(step ms, median of 10 interleaved steps)",
    )
    print(f"wrote {write_results('pipeline-split', payload)}")


def projection_section(payload: dict[str, Any], *, device: str) -> None:
    block = measure_block(device)
    proj = projection_rows(block)
    where = "this cpu (fp32)" if device == "cpu" else f"{device} (bf16): {machine().get('gpu', device)}"
    payload["projection"] = {
        "assumptions": {
            "model": f"{PROJ_LAYERS} blocks, d_model {PROJ_D}, {PROJ_HEADS} heads (GPT-2 1.3B-shaped)",
            "micro_batch": f"1 sequence of {PROJ_T} tokens",
            "global_batch": f"{SEQS_PER_DEVICE} x devices sequences (weak scaling), N = {SEQS_PER_DEVICE} x D",
            "device_memory_gib": DEVICE_GIB,
            "state_bytes_per_param": STATE_BYTES_PER_PARAM,
            "activation_bytes_per_block_per_microbatch": ACT_BYTES_PER_BLOCK,
            "block_costs_measured_on": where,
            "block_costs_s": block,
            "link": f"{LINK_GBPS} GB/s, {LINK_LATENCY_S * 1e6:.0f} us latency (assumed)",
            "grad_sync": "ring all-reduce, not overlapped with compute, fp32 gradients",
            "optimizer": "measured AdamW step per block, times the blocks a rank holds (2 copies for Chimera)",
            "memory": "a configuration must fit the device; if not, activation recomputation is tried "
            "(backward += forward, only stage inputs stashed); best depth D in {2,4,8,16} per scheme",
        },
        "rows": proj,
    }
    print(
        f"4. projection, GPT-2 1.3B-shaped; per block fwd {block['forward_s'] * 1e3:.2f} ms / bwd "
        f"{block['backward_s'] * 1e3:.2f} ms / AdamW step {block['adamw_step_s'] * 1e3:.2f} ms measured on "
        f"{where} (assumptions in the JSON); the Chimera paper reports 1.16-2.34x on 2048 GPUs"
    )
    print(table(proj))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="skip the real gloo runs")
    ap.add_argument("--executed-only", action="store_true", help="only sections 5 and 6 (gloo runs)")
    ap.add_argument("--split-only", action="store_true", help="only section 6 (gloo runs)")
    ap.add_argument(
        "--projection-device",
        default=None,
        help="only section 4, with the block costs measured on this device (e.g. cuda: bf16); "
        "writes bench/results/pipeline-projection-<device>.json",
    )
    args = ap.parse_args()
    torch.set_num_threads(2)
    payload: dict[str, Any] = {}

    if args.projection_device:
        projection_section(payload, device=args.projection_device)
        print(f"wrote {write_results(f'pipeline-projection-{args.projection_device}', payload)}")
        return
    if args.executed_only or args.split_only:
        if args.executed_only:
            executed_sections(payload)
            print(f"wrote {write_results('pipeline-executed', payload)}")
        split_sections()
        return
    t = time.perf_counter()
    sim = simulated_rows()
    payload["simulated"] = sim
    bubble_cols = [
        "D",
        "N",
        "bwd/fwd",
        *[f"bubble {n}" for n in SCHEDULES],
        "1f1b formula",
        "chimera formula",
    ]
    stash_cols = ["D", "N", "bwd/fwd", *[f"stash {n}" for n in SCHEDULES]]
    print(
        table([{c: r[c] for c in bubble_cols} for r in sim], title="1. simulated bubble ratio (unit forward)")
    )
    print(
        table(
            [{c: r[c] for c in stash_cols} for r in sim],
            title="   peak stashed activations per rank (min-max)",
        )
    )
    goals = {
        "chimera <= 0.5x 1f1b bubble at N=D (bwd=1x)": {
            D: round(r["bubble chimera"] / r["bubble 1f1b"], 3)
            for r in sim
            if r["N"] == r["D"]
            for D in [r["D"]]
            if r["bwd/fwd"] == 1.0
        },
        "chimera-zb bubble at D=N=4, bwd=2x": next(
            r["bubble chimera-zb"] for r in sim if (r["D"], r["N"], r["bwd/fwd"]) == (4, 4, 2.0)
        ),
    }
    print(f"   goals: {goals}  ({time.perf_counter() - t:.1f}s)\n")
    payload["goals"] = goals

    jit = jitter_rows()
    payload["jitter"] = jit
    print(
        table(
            jit, title="2. message-driven vs static 1F1B, +/-30% compute jitter, bwd=2x (simulated, 20 seeds)"
        )
    )

    if not args.quick:
        timed_section(
            payload,
            "real_jitter_d4",
            real_jitter_rows,
            title="2b. executed on 4 gloo ranks: compute stood in by sleeps of 10 ms (F) / 20 ms (B) "
            "+/-30%, same draws for both",
        )
        timed_section(
            payload,
            "real_gloo_d4",
            real_rows,
            title="3. real runs of the pipeline job, gloo ranks on this machine "
            "(GPT 6 blocks x 128, batch 16, seq 64)",
        )

        executed_sections(payload)
        split_sections()

    projection_section(payload, device="cpu")
    path = write_results("pipeline", payload)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
