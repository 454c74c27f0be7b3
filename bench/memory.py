"""Memory benchmark for HYDRA spilling and the AxoNN offloaded optimizer.

    .venv/bin/python -m bench.memory [--budget-mb 16] [--steps 8]
    python -m bench.memory --gpu-only [--throughput-only]     the GPU rows (memory_gpu.json)

Rows:
1. largest GPT (8 blocks, width searched) trainable under a fixed device budget: resident vs spilled
   vs spilled + offloaded optimizer (bf16). The search uses the partitioner's plan from meta-device
   estimates; the largest model of each mode is then really trained for 2 steps with a strict
   device ledger. On CPU "trainable" means: the ledger's peak stayed under the budget (there is no
   device allocator to ask); on CUDA the allocator's peak is reported beside it.
2. device bytes per parameter with the offloaded optimizer, measured by a census of the storages the
   kernels of a real training step compute on (tests/device_census.py), beside the ledger's peak.
3. throughput of spilled relative to resident training on a model that fits both ways, with
   prefetch off and on, and with the optimizer state on the host (`parallel.spill.optimizer:
   "host"`). Each spilled row states the bytes it moves per step and, on CUDA, what those take at
   the link's measured speed, so its copy-bound limit is a number: the step can be no faster than
   that or than the same recompute resident (`limit_x_resident`; `x_limit` is how close it comes). On CPU this measures the engine's own overhead (copies between separate
   host and "device" buffers, bookkeeping, and the recompute of every shard but the last); there is
   no side stream, so prefetch cannot overlap anything there.
4. GPU rows (spilled vs resident with prefetch, against FSDP2 with CPUOffloadPolicy): run only where
   CUDA exists, else written as "pending".
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from bench.common import RESULTS, machine, table, write_results
from jobrules.spec import DataSpec, ModelSpec, OffloadSpec, TrainSpec
from tests.device_census import DeviceCensus, Seen
from trainer.data import BatchStream, load_data
from trainer.models import build_model, count_params, lm_loss, recipe_for
from trainer.optim import build_optimizer
from trainer.recipe import meta_layers
from trainer.spill.engine import SpillEngine, default_bucket_numel
from trainer.spill.ledger import DeviceLedger, MiB, cuda_check
from trainer.spill.offload import bucket_bytes
from trainer.spill.partition import (
    DoesNotFit,
    SpillPlan,
    library_workspace_bytes,
    measure_layers,
    partition,
    plan_peak,
)

SEARCH_LAYERS = 8
SEARCH_HEADS = 4
SEARCH_SEQ = 64
SEARCH_BATCH = 2
BF16 = OffloadSpec(optimizer=True, dtype="bf16")


def stream_for(mcfg: ModelSpec, batch: int) -> BatchStream:
    data = load_data(DataSpec(max_chars=400_000), seq_len=mcfg.seq_len)
    return BatchStream(data=data, batch_size=batch, seed=0)


def gpt(d_model: int, *, layers: int = SEARCH_LAYERS, seq: int = SEARCH_SEQ) -> ModelSpec:
    return ModelSpec(kind="gpt", layers=layers, d_model=d_model, heads=SEARCH_HEADS, seq_len=seq)


def plan_for(
    mcfg: ModelSpec,
    *,
    mode: str,
    budget: int | None,
    batch: int,
    device: torch.device | str = "meta",
    reserved: int = 0,
) -> tuple[SpillPlan, int]:
    """Plan of `mode` (resident | spilled | offload) from costs measured on `device`; the model is
    built on the meta device when only estimating, so wide models cost nothing to plan. `reserved`:
    the library workspaces a CUDA run holds beside the shards (a job reserves them the same way)."""
    offload = mode == "offload"
    if str(device) == "meta":
        model = torch.nn.Sequential(*meta_layers(recipe_for(mcfg)))
    else:
        model = build_model(mcfg, seed=0)
    costs = measure_layers(
        model,
        batch_size=batch,
        seq_len=mcfg.seq_len,
        state_bpp=0 if offload else 8,
        param_dtype=torch.bfloat16 if offload else torch.float32,
        device=device,
    )
    extra = bucket_bytes(default_bucket_numel(model)) if offload else 0
    if mode == "resident":
        peak = plan_peak(costs, cuts=[], prefetch=False, extra_bytes=reserved)[0]
        if budget is not None and peak > budget:
            raise DoesNotFit(f"resident peak {peak / MiB:.1f} MiB > budget")
        plan = partition(costs, budget_bytes=None, prefetch=False, cuts=[], reserved_bytes=reserved)
        return plan, count_params(model)
    plan = partition(costs, budget_bytes=budget, prefetch=True, extra_bytes=extra, reserved_bytes=reserved)
    return plan, count_params(model)


def largest_width(*, mode: str, budget: int, step: int = 16, reserved: int = 0) -> int | None:
    best = None
    for d in range(step * 2, 8192, step):
        try:
            plan_for(gpt(d), mode=mode, budget=budget, batch=SEARCH_BATCH, reserved=reserved)
        except DoesNotFit:
            break
        best = d
    return best


def train_under_ledger(
    mcfg: ModelSpec, *, mode: str, budget: int, device: torch.device, reserved: int, steps: int = 2
) -> dict[str, Any]:
    """Really train the model `steps` steps with a strict ledger (raises if the budget is passed).
    `reserved`: the library workspaces `largest_rows` measured, which this process holds from then
    on (every row trains on the same threads and streams, so they are the same ones)."""
    model = build_model(mcfg, seed=0)
    offload = BF16 if mode == "offload" else None
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    # the baseline leaves the workspaces out (the ledger holds them): the allocator's peak counts them
    base = torch.cuda.memory_allocated(device) - reserved if device.type == "cuda" else 0
    plan, _ = plan_for(mcfg, mode=mode, budget=budget, batch=SEARCH_BATCH, device="meta", reserved=reserved)
    ledger = DeviceLedger(budget_bytes=budget, strict=True)
    engine = SpillEngine(
        model,
        plan=plan,
        train=TrainSpec(steps=steps),
        device=device,
        ledger=ledger,
        prefetch=True,
        offload=offload,
    )
    stream = stream_for(mcfg, SEARCH_BATCH)
    losses = [engine.train_step(*stream.batch_for(s)) for s in range(steps)]
    out: dict[str, Any] = {"shards": plan.n_shards, "ledger_peak_mb": ledger.peak / MiB, "loss": losses[-1]}
    if device.type == "cuda":
        out["cuda_peak_mb"] = cuda_check(ledger, device=device, baseline_bytes=base)["cuda_peak_mb"]
    engine.release()
    return out


def largest_rows(*, budget_mb: float, device: torch.device) -> list[dict[str, Any]]:
    budget = int(budget_mb * MiB)
    reserved = library_workspace_bytes(device)  # 0 off CUDA
    rows = []
    resident_params = None
    for mode in ("resident", "spilled", "offload"):
        d = largest_width(mode=mode, budget=budget, reserved=reserved)
        if d is None:
            rows.append({"mode": mode, "budget_mb": budget_mb, "d_model": "none fits"})
            continue
        mcfg = gpt(d)
        n = sum(_param_counts(mcfg))
        resident_params = resident_params or n
        t0 = time.perf_counter()
        run = train_under_ledger(mcfg, mode=mode, budget=budget, device=device, reserved=reserved)
        rows.append(
            {
                "mode": mode if mode != "offload" else "spilled+offload(bf16)",
                "budget_mb": budget_mb,
                "d_model": d,
                "params_M": n / 1e6,
                "x_resident": n / resident_params,
                "fp32_param_mb": 4 * n / MiB,
                "shards": run["shards"],
                "workspace_mb": reserved / MiB,
                "ledger_peak_mb": run["ledger_peak_mb"],
                "cuda_peak_mb": run.get("cuda_peak_mb", "n/a (cpu)"),
                "trained": f"2 steps, loss {run['loss']:.3f}, {time.perf_counter() - t0:.1f}s",
            }
        )
    return rows


def _param_counts(mcfg: ModelSpec) -> list[int]:
    model = meta_layers(recipe_for(mcfg))
    return [sum(p.numel() for p in layer.parameters()) for layer in model]


def census_of_step(engine: SpillEngine, stream: BatchStream) -> tuple[DeviceCensus, list[list[Seen]]]:
    """A census (tests/device_census.py) of the storages the kernels of the engine's second
    training step compute on, with a snapshot of the live ones right after each optimizer step of a
    shard (parameters, gradients and bucket buffers are all held then)."""
    assert engine.opt is not None
    engine.train_step(*stream.batch_for(0))
    snaps: list[list[Seen]] = []
    step_group = engine.opt.step_group

    def watched(*args: Any, **kwargs: Any) -> None:
        step_group(*args, **kwargs)
        snaps.append(census.live())

    engine.opt.step_group = watched  # type: ignore[method-assign]
    try:
        with DeviceCensus(engine.device) as census:
            engine.train_step(*stream.batch_for(1))
    finally:
        del engine.opt.step_group  # back to the class's method
    return census, snaps


def bytes_per_param_rows(*, device: torch.device) -> list[dict[str, Any]]:
    """Device bytes/param of the offloaded optimizer, model resident (one shard) and spilled,
    measured by a census of the storages a real step computes on (not read from the ledger)."""
    rows = []
    for layers, d in ((8, 256), (8, 512)):
        mcfg = gpt(d, layers=layers)
        for cuts_mode in ("one shard", "one layer per shard"):
            model = build_model(mcfg, seed=0)
            n = count_params(model)
            costs = measure_layers(
                model, batch_size=SEARCH_BATCH, seq_len=mcfg.seq_len, state_bpp=0, param_dtype=torch.bfloat16
            )
            cuts = [] if cuts_mode == "one shard" else list(range(1, len(costs)))
            plan = partition(costs, budget_bytes=None, prefetch=True, cuts=cuts)
            ledger = DeviceLedger()
            engine = SpillEngine(
                model, plan=plan, train=TrainSpec(steps=2), device=device, ledger=ledger, offload=BF16
            )
            census, snaps = census_of_step(engine, stream_for(mcfg, SEARCH_BATCH))
            low = max(sum(s.nbytes for s in snap if s.dtype == torch.bfloat16) for snap in snaps)
            held = max(sum(s.nbytes for s in snap) for snap in snaps)
            rows.append(
                {
                    "model": f"gpt L{layers} d{d}",
                    "params_M": n / 1e6,
                    "shards": cuts_mode,
                    "bf16 params+grads B/param": low / n,
                    "all held at a step B/param": held / n,
                    "fp32 held B/param": census.alive_bytes(torch.float32) / n,
                    "census peak B/param": census.peak_bytes / n,
                    "ledger peak B/param": ledger.peak / n,
                }
            )
            engine.release()
    return rows


def _plain_step(model: torch.nn.Module, tcfg: TrainSpec, device: torch.device):
    """One ordinary forward/backward/optimizer step of `model` (already placed)."""
    opt = build_optimizer(model.parameters(), tcfg)

    def step(x: torch.Tensor, y: torch.Tensor) -> float:
        loss = lm_loss(model(x.to(device)), y.to(device))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        return loss.item()

    return step


def _resident_stepper(mcfg: ModelSpec, tcfg: TrainSpec, device: torch.device):
    return _plain_step(build_model(mcfg, seed=0).to(device), tcfg, device)


def _checkpointed_stepper(mcfg: ModelSpec, tcfg: TrainSpec, device: torch.device, *, cuts: list[int]):
    """Resident training that recomputes the same segments the engine recomputes (activation
    checkpointing at the shard cuts, the last segment kept): the like-for-like baseline that
    isolates the engine's own cost (copies, bookkeeping) from the recompute."""
    from torch.utils.checkpoint import checkpoint

    model = build_model(mcfg, seed=0).to(device)
    opt = build_optimizer(model.parameters(), tcfg)
    edges = [0, *cuts, len(model)]
    segments = [model[a:b] for a, b in zip(edges[:-1], edges[1:], strict=True)]

    def step(x: torch.Tensor, y: torch.Tensor) -> float:
        h = x.to(device)
        for seg in segments[:-1]:
            h = checkpoint(seg, h, use_reentrant=False)
        loss = lm_loss(segments[-1](h), y.to(device))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        return loss.item()

    return step


def _engine(
    mcfg: ModelSpec,
    tcfg: TrainSpec,
    device: torch.device,
    *,
    cuts: list[int],
    prefetch: bool,
    host: bool = False,
) -> SpillEngine:
    model = build_model(mcfg, seed=0)
    costs = measure_layers(
        model, batch_size=tcfg.batch_size, seq_len=mcfg.seq_len, state_bpp=0 if host else 8
    )
    plan = partition(costs, budget_bytes=None, prefetch=prefetch, cuts=cuts)
    return SpillEngine(
        model, plan=plan, train=tcfg, device=device, ledger=DeviceLedger(), prefetch=prefetch, host_step=host
    )


def link_bandwidth(device: torch.device, *, mib: int = 128, reps: int = 5) -> dict[str, float] | None:
    """Pinned host <-> device copy speed in GB/s, each way alone (medians); None off CUDA."""
    if device.type != "cuda":
        return None
    n = mib * 2**20 // 4
    host, dev = torch.empty(n, pin_memory=True), torch.empty(n, device=device)
    out = {}
    for way, (dst, src) in {"h2d_GBps": (dev, host), "d2h_GBps": (host, dev)}.items():
        ts = []
        for _ in range(reps + 1):
            torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            dst.copy_(src, non_blocking=True)
            torch.cuda.synchronize(device)
            ts.append(time.perf_counter() - t0)
        out[way] = n * 4 / statistics.median(ts[1:]) / 1e9
    return out


def copy_bound(
    *, moved: tuple[float, float], link: dict[str, float] | None, overlapped: bool
) -> float | None:
    """Milliseconds a step's copies take at the link's measured speed: in one stream one after the
    other (weights and state in, then out), or on two streams at once (host mode: the gradients
    leave on a stream of their own)."""
    if link is None:
        return None
    h2d = moved[0] / (link["h2d_GBps"] * 1e9) * 1e3
    d2h = moved[1] / (link["d2h_GBps"] * 1e9) * 1e3
    return max(h2d, d2h) if overlapped else h2d + d2h


def _fsdp2_offload_stepper(mcfg: ModelSpec, tcfg: TrainSpec, device: torch.device):
    """PyTorch FSDP2 with CPUOffloadPolicy on one GPU: what a user would pick instead."""
    import torch.distributed as dist
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    if not dist.is_initialized():
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    model = build_model(mcfg, seed=0)
    for layer in model:
        fully_shard(layer, offload_policy=CPUOffloadPolicy())
    fully_shard(model, offload_policy=CPUOffloadPolicy())
    return _plain_step(model, tcfg, device)


def throughput_rows(*, device: torch.device, steps: int, gpu: bool) -> list[dict[str, Any]]:
    """Round-robin over the variants (one step each per round) so load from other processes on a
    shared machine hits them all alike; the median step time of each is reported."""
    if gpu:
        mcfg = ModelSpec(kind="gpt", layers=8, d_model=1024, heads=16, seq_len=256)
        tcfg = TrainSpec(steps=steps, batch_size=8, lr=1e-4)
    else:
        mcfg = ModelSpec(kind="gpt", layers=4, d_model=128, heads=4, seq_len=64)
        tcfg = TrainSpec(steps=steps, batch_size=8, lr=1e-4)
    n_layers = mcfg.layers + 2
    three = [n_layers // 3, 2 * n_layers // 3]
    each = list(range(1, n_layers))
    engines: dict[str, SpillEngine] = {
        "engine, 1 shard (no spill)": _engine(mcfg, tcfg, device, cuts=[], prefetch=True),
        "spilled, 3 shards, prefetch on": _engine(mcfg, tcfg, device, cuts=three, prefetch=True),
        "spilled, 3 shards, prefetch off": _engine(mcfg, tcfg, device, cuts=three, prefetch=False),
        "spilled, 3 shards, host optimizer": _engine(
            mcfg, tcfg, device, cuts=three, prefetch=True, host=True
        ),
        "spilled, 1 layer/shard, prefetch on": _engine(mcfg, tcfg, device, cuts=each, prefetch=True),
        "spilled, 1 layer/shard, prefetch off": _engine(mcfg, tcfg, device, cuts=each, prefetch=False),
        "spilled, 1 layer/shard, host optimizer": _engine(
            mcfg, tcfg, device, cuts=each, prefetch=True, host=True
        ),
    }
    variants: dict[str, Any] = {
        "resident (loop.train step)": _resident_stepper(mcfg, tcfg, device),
        "resident + checkpointing, 3 segments": _checkpointed_stepper(mcfg, tcfg, device, cuts=three),
        "resident + checkpointing, 1 layer/segment": _checkpointed_stepper(mcfg, tcfg, device, cuts=each),
        **{name: e.train_step for name, e in engines.items()},
    }
    # each engine variant -> the like-for-like resident baseline with the same recompute
    same_recompute = {
        name: (
            "resident (loop.train step)"
            if name.startswith("engine")
            else "resident + checkpointing, 3 segments"
            if "3 shards" in name
            else "resident + checkpointing, 1 layer/segment"
        )
        for name in engines
    }
    if gpu:
        variants["FSDP2 CPUOffloadPolicy"] = _fsdp2_offload_stepper(mcfg, tcfg, device)
    stream = stream_for(mcfg, tcfg.batch_size)
    times: dict[str, list[float]] = {k: [] for k in variants}
    moved_from: dict[str, tuple[int, int]] = {}
    for step in range(steps + 2):
        if step == 2:
            moved_from = {name: e.bytes_moved() for name, e in engines.items()}
        for name, fn in variants.items():
            x, y = stream.batch_for(step)
            if device.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn(x, y)  # returns loss.item(): the step is complete when it returns
            if step >= 2:  # the first two are warm-up
                times[name].append(time.perf_counter() - t0)
    tokens = tcfg.batch_size * mcfg.seq_len
    med = {name: statistics.median(ts) for name, ts in times.items()}
    base = med["resident (loop.train step)"]
    link = link_bandwidth(device)
    rows = []
    for name, m in med.items():
        like = same_recompute.get(name)
        row: dict[str, Any] = {
            "variant": name,
            "device": str(device),
            "model": f"gpt L{mcfg.layers} d{mcfg.d_model} T{mcfg.seq_len} B{tcfg.batch_size}",
            "median_step_ms": m * 1e3,
            "tokens_per_s": tokens / m,
            "x_resident": base / m,
            "x_same_recompute": med[like] / m if like else "",
            **dict.fromkeys(
                ("in_MB_per_step", "out_MB_per_step", "copy_ms", "limit_x_resident", "x_limit"), ""
            ),
        }
        if name in engines:
            e = engines[name]
            now = e.bytes_moved()
            moved = ((now[0] - moved_from[name][0]) / steps, (now[1] - moved_from[name][1]) / steps)
            copy_ms = copy_bound(moved=moved, link=link, overlapped=e.host is not None)
            compute_ms = med[like] * 1e3 if like else None
            # the step can be no faster than its compute (the same recompute, resident) or its copies
            limit_ms = max(compute_ms or 0.0, copy_ms or 0.0) or None
            row.update(
                {
                    "in_MB_per_step": moved[0] / 1e6,
                    "out_MB_per_step": moved[1] / 1e6,
                    "copy_ms": copy_ms if copy_ms is not None else "",
                    "limit_x_resident": base * 1e3 / limit_ms if limit_ms and copy_ms is not None else "",
                    "x_limit": limit_ms / (m * 1e3) if limit_ms and copy_ms is not None else "",
                }
            )
        rows.append(row)
    for e in engines.values():
        e.close()
    return rows


def pending_gpu_rows() -> list[dict[str, Any]]:
    return [
        {"variant": v, "device": "cuda", "status": "pending: no GPU in this run"}
        for v in (
            "largest model under budget (allocator peak)",
            "spilled vs resident, prefetch on (goal >= 0.75x)",
            "prefetch on vs off (HYDRA: 1.5-2x)",
            "spilled vs FSDP2 CPUOffloadPolicy (goal >= 1.0x)",
        )
    ]


def gpu_throughput(*, steps: int) -> dict[str, Any]:
    """The throughput rows on this machine's GPU, with the link's speed. The host optimizer steps
    on the host's cores: a GPU machine is not shared, so every core is the trainer's."""
    dev = torch.device("cuda")
    threads = os.cpu_count() or 1
    torch.set_num_threads(threads)
    return {
        "throughput": throughput_rows(device=dev, steps=steps, gpu=True),
        "link": link_bandwidth(dev),
        "host_threads": threads,
    }


def gpu_rows(*, budget_mb: float, steps: int) -> dict[str, Any]:
    """Row 1 under a 64x larger budget and row 3 at a GPU-sized model, on this machine's GPU."""
    dev = torch.device("cuda")
    gpu = {"largest": largest_rows(budget_mb=budget_mb * 64, device=dev), **gpu_throughput(steps=steps)}
    print(table(gpu["largest"], title=f"GPU: largest model under a {budget_mb * 64:g} MiB budget"))
    print(table(gpu["throughput"], title="GPU: throughput (incl. FSDP2 CPUOffloadPolicy)"))
    return gpu


def update_results(name: str, part: dict[str, Any], *, run_key: str) -> Path:
    """Replace `part`'s keys in an existing results file, stamped under `run_key` with this
    machine and the time (the rest of the file keeps its own)."""
    path = RESULTS / name
    doc = json.loads(path.read_text())
    doc.update(part)
    doc[run_key] = {"machine": machine(), "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    path.write_text(json.dumps(doc, indent=2) + "\n")
    return path


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.memory")
    ap.add_argument("--budget-mb", type=float, default=16.0)
    ap.add_argument("--steps", type=int, default=10, help="timed steps per throughput variant")
    ap.add_argument(
        "--only-bytes-per-param",
        action="store_true",
        help="measure only row 2 and replace it in the existing results file (stamped with its own time)",
    )
    ap.add_argument(
        "--gpu-only",
        action="store_true",
        help="only the GPU rows (needs CUDA), written to bench/results/memory_gpu.json",
    )
    ap.add_argument(
        "--throughput-only",
        action="store_true",
        help="with --gpu-only: only the throughput rows, replaced in bench/results/memory_gpu.json",
    )
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    # one intra-op thread: the machine is shared, and a fixed thread count keeps the resident and
    # spilled rows comparable (with 2 threads on a loaded 2-core box the noise swamps the signal)
    torch.set_num_threads(1)
    t_start = time.perf_counter()
    cpu = torch.device("cpu")

    if args.only_bytes_per_param:
        bpp = bytes_per_param_rows(device=cpu)
        print(table(bpp, title="Device bytes per parameter with the offloaded optimizer (bf16), census"))
        path = update_results(
            "memory.json", {"offload_bytes_per_param": bpp}, run_key="offload_bytes_per_param_run"
        )
        print(f"updated offload_bytes_per_param in {path}")
        return

    if args.gpu_only:
        if not torch.cuda.is_available():
            raise SystemExit("--gpu-only needs a CUDA device; this machine has none")
        if args.throughput_only:
            part = gpu_throughput(steps=args.steps)
            print(table(part["throughput"], title="GPU: throughput (incl. FSDP2 CPUOffloadPolicy)"))
            path = update_results("memory_gpu.json", part, run_key="throughput_run")
            print(f"updated the throughput rows of {path} in {time.perf_counter() - t_start:.0f}s")
            return
        gpu_doc = gpu_rows(budget_mb=args.budget_mb, steps=args.steps)
        path = write_results("memory_gpu", {"budget_mb": args.budget_mb * 64, **gpu_doc})
        print(f"wrote {path} on {machine().get('gpu')} in {time.perf_counter() - t_start:.0f}s")
        return

    t0 = time.perf_counter()
    largest = largest_rows(budget_mb=args.budget_mb, device=cpu)
    print(f"(largest-model search and training: {time.perf_counter() - t0:.0f}s)")
    print(
        table(
            largest,
            title=f"Largest GPT (8 blocks, T={SEARCH_SEQ}, B={SEARCH_BATCH}, AdamW) under a "
            f"{args.budget_mb:g} MiB device budget (CPU: trainable = strict ledger stayed under the budget)",
        )
    )
    bpp = bytes_per_param_rows(device=cpu)
    print(table(bpp, title="Device bytes per parameter with the offloaded optimizer (bf16), census"))
    cpu_tp = throughput_rows(device=cpu, steps=args.steps, gpu=False)
    print(table(cpu_tp, title="Throughput on CPU (engine overhead incl. recompute; no side stream on CPU)"))

    gpu: dict[str, Any]
    if torch.cuda.is_available():
        gpu = gpu_rows(budget_mb=args.budget_mb, steps=args.steps)
    else:
        gpu = {"pending": pending_gpu_rows()}
        print(table(gpu["pending"], title="GPU rows"))

    path = write_results(
        "memory",
        {
            "budget_mb": args.budget_mb,
            "largest_under_budget": largest,
            "offload_bytes_per_param": bpp,
            "throughput_cpu": cpu_tp,
            "gpu": gpu,
            "notes": [
                "CPU: 'trainable' is decided by the engine's device ledger (strict: raises past the "
                "budget), since a CPU has no device allocator to measure",
                "CPU throughput includes the recompute of every shard but the last (activation "
                "checkpointing at shard boundaries) and host<->'device' copies between separate "
                "buffers; prefetch has no side stream to overlap on CPU",
            ],
        },
    )
    print(f"wrote {path} on {machine()['cpu']} in {time.perf_counter() - t_start:.0f}s")


if __name__ == "__main__":
    main()
