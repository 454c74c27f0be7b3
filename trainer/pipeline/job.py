"""A pipeline-parallel training job under torchrun: one rank per stage, the schedule from the spec.

Order of set-up, once: process group, schedule (checked), model from the seed, cut into this rank's
stage modules (two for Chimera), optimizer over what this rank holds. Every step draws the same
global batch as trainer/loop.py (BatchStream.batch_for(step - 1)), so losses match the single-
process loop. Rank 0 emits the metrics; the executed and simulated timelines go out as a
`timeline` event every eval_every steps and at the end.
"""

from __future__ import annotations

import math
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from trainer.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from trainer.config import ConfigError, JobConfig, TrainConfig
from trainer.data import BatchStream, TextData
from trainer.device import pick_device
from trainer.distributed import init_from_env
from trainer.loop import StepRange, build_optimizer, check_finite, report_step, run_summary
from trainer.models import build_model, count_params, lm_loss
from trainer.pipeline.checker import check_schedule
from trainer.pipeline.executor import PipelineExecutor
from trainer.pipeline.schedules import COMPUTE_OPS, Schedule, build_schedule
from trainer.pipeline.simulate import Costs, simulate, summarize
from trainer.pipeline.stage import build_stages
from trainer.protocol import MetricsSink, StopSignal


def measured_costs(timeline: list[dict[str, Any]], *, sched: Schedule) -> Costs:
    """Per-stage mean F/B/W durations from an executed timeline; transfer is the smallest observed
    hand-off gap (producer's end to consumer's start), a latency estimate that excludes queueing."""
    spans: dict[tuple[int, str], list[float]] = defaultdict(list)
    ends: dict[tuple[str, int, int, int], float] = {}
    for e in timeline:
        if e["op"] in COMPUTE_OPS:
            spans[(e["stage"], e["op"])].append(e["end"] - e["start"])
            ends[(e["op"], e["mb"], e["stage"], e["replica"])] = e["end"]
    gaps = [
        e["start"] - ends[("F", e["mb"], e["stage"] - 1, e["replica"])]
        for e in timeline
        if e["op"] == "F" and e["stage"] > 0 and ("F", e["mb"], e["stage"] - 1, e["replica"]) in ends
    ]

    def mean(stage: int, op: str) -> float:
        xs = spans.get((stage, op), [])
        return sum(xs) / len(xs) if xs else 0.0

    per_stage = {s: (mean(s, "F"), mean(s, "B"), mean(s, "W")) for s in range(sched.stages)}
    f = [v[0] for v in per_stage.values() if v[0] > 0] or [1.0]
    b = [v[1] + v[2] for v in per_stage.values() if v[1] > 0] or [1.0]
    return Costs(
        forward=sum(f) / len(f),
        backward=sum(b) / len(b),
        transfer=max(0.0, min(gaps, default=0.0)),
        per_stage=per_stage,
    )


def timeline_event(timelines: list[list[dict[str, Any]]], *, sched: Schedule) -> dict[str, Any]:
    executed = sorted((e for tl in timelines for e in tl), key=lambda e: (e["rank"], e["start"]))
    costs = measured_costs(executed, sched=sched)
    sim = simulate(sched, costs)
    return {
        "schedule": sched.name,
        "stages": sched.stages,
        "microbatches": sched.microbatches,
        "executed": executed,
        "simulated": sim.timeline,
        "bubble_executed": summarize(executed, ranks=sched.stages, split=sched.split_backward).bubble,
        "bubble_simulated": sim.bubble,
        "peak_stash_simulated": sim.peak_stash,
    }


@torch.no_grad()
def pipeline_evaluate(
    modules: dict[tuple[int, int], nn.Module],
    *,
    data: TextData,
    cfg: TrainConfig,
    rank: int,
    stages: int,
    act_shape: tuple[int, ...],
    device: torch.device,
) -> float:
    """loop.evaluate's batches, passed down the replica-0 stages with blocking send/recv."""
    mod = modules[(rank, 0)]
    mod.eval()
    g = torch.Generator().manual_seed(cfg.seed + 7919)
    total = torch.zeros(1, dtype=torch.float64, device=device)
    for _ in range(cfg.eval_batches):
        x, y = data.batch(split="val", batch_size=cfg.batch_size, generator=g)
        if rank == 0:
            h = mod(x.to(device))
        else:
            h = torch.empty(act_shape, device=device)
            dist.recv(h, src=rank - 1)
            h = mod(h)
        if rank < stages - 1:
            dist.send(h.contiguous(), dst=rank + 1)
        else:
            total += lm_loss(h, y.to(device)).double()
    mod.train()
    dist.broadcast(total, src=stages - 1)
    return total.item() / cfg.eval_batches


def _clip(modules: dict[tuple[int, int], nn.Module], *, rank: int, max_norm: float) -> None:
    """Global-norm clipping across ranks; each stage counted once (its replica-0 copy)."""
    p0 = next(modules[(rank, 0)].parameters())
    # on the parameters' device: NCCL reduces device tensors only
    sq = torch.zeros(1, dtype=torch.float64, device=p0.device)
    for p in modules[(rank, 0)].parameters():
        if p.grad is not None:
            sq += p.grad.detach().double().pow(2).sum()
    dist.all_reduce(sq)
    coef = max_norm / (math.sqrt(sq.item()) + 1e-6)
    if coef < 1.0:
        for m in modules.values():
            for p in m.parameters():
                if p.grad is not None:
                    p.grad.mul_(coef)


def train_pipeline(
    job: JobConfig,
    *,
    sink: MetricsSink,
    stop: StopSignal,
    checkpoint_dir: Path | None = None,
) -> dict[str, Any]:
    pipe = job.parallel.pipeline
    if pipe is None or pipe.stages < 2:
        raise ConfigError("train_pipeline needs parallel.pipeline.stages >= 2")
    if job.parallel.data_parallel != 1 or (
        job.parallel.tensor is not None and job.parallel.tensor.world_size > 1
    ):
        raise ConfigError("pipeline jobs with data_parallel > 1 or tensor parallelism are not supported yet")
    # the executor's messages are untagged and ordered for NCCL (checker.check_nccl), so CUDA
    # ranks talk over NCCL; CPU ranks over gloo
    init_from_env(device_type=pick_device(job.resources.device).type)
    device = pick_device(job.resources.device)
    rank, world = dist.get_rank(), dist.get_world_size()
    D, N = pipe.stages, pipe.microbatches
    if world != D:
        raise ConfigError(f"parallel.pipeline.stages ({D}) != world size ({world})")
    lead = rank == 0
    cfg = job.train

    sched = build_schedule(pipe.schedule, stages=D, microbatches=N)
    check_schedule(sched)
    model = build_model(job.model, seed=cfg.seed)
    n_params = count_params(model)
    modules = {k: m.to(device) for k, m in build_stages(model, sched=sched, rank=rank).items()}
    del model
    opt = build_optimizer([p for m in modules.values() for p in m.parameters()], cfg)
    data = TextData.from_config(job.data, seq_len=job.model.seq_len)
    stream = BatchStream(data=data, batch_size=cfg.batch_size, seed=cfg.seed)
    act_shape = (cfg.batch_size // N, job.model.seq_len, job.model.d_model)
    executor = PipelineExecutor(sched=sched, rank=rank, modules=modules, act_shape=act_shape, device=device)
    my_dir = checkpoint_dir / f"pipeline-rank{rank}" if checkpoint_dir is not None else None

    start = 0
    if (path := latest_checkpoint(my_dir)) is not None:
        state = load_checkpoint(path)
        for key, m in modules.items():
            m.load_state_dict(state["modules"][f"{key[0]}.{key[1]}"])
        opt.load_state_dict(state["optimizer"])
        start = int(state["step"])
    agreed = torch.tensor([start, -start], device=device)
    dist.all_reduce(agreed, op=dist.ReduceOp.MIN)
    if int(agreed[0]) != -int(agreed[1]):
        raise RuntimeError(
            f"pipeline ranks resumed from different steps ({int(agreed[0])}..{-int(agreed[1])})"
        )
    if lead:
        if start:
            sink.log(f"resumed at step {start}")
        sink.log(
            f"model {job.model.kind}: {n_params:,} parameters, pipeline {pipe.schedule} "
            f"D={D} N={N} on {device}"
        )
        sink.event("start", {"params": n_params, "device": str(device), "start_step": start})

    def save(step: int) -> Path | None:
        if my_dir is None:
            return None
        state = {
            "modules": {f"{s}.{rep}": m.state_dict() for (s, rep), m in modules.items()},
            "optimizer": opt.state_dict(),
        }
        return save_checkpoint(my_dir, step=step, state=state)

    tokens_per_step = cfg.batch_size * job.model.seq_len
    loss_value = val_loss = bubble = float("nan")
    steps = StepRange(start=start, end=cfg.steps, stop=stop)
    for step in steps:
        x, y = stream.batch_for(step - 1)
        # align the ranks' clocks for the timeline: every rank starts the step together
        dist.barrier()
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        rec = executor.step(x, y, t0=t0)
        if cfg.grad_clip > 0:
            _clip(modules, rank=rank, max_norm=cfg.grad_clip)
        opt.step()
        loss = torch.tensor([rec.loss], dtype=torch.float64, device=device)
        dist.all_reduce(loss)  # note: also the step's synchronisation point
        dt = time.perf_counter() - t0
        loss_value = loss.item()
        check_finite(loss_value, step)
        if lead:
            report_step(sink, step=step, loss=loss_value, seconds=dt, tokens=tokens_per_step, device=device)
        last = step == cfg.steps
        if step % cfg.eval_every == 0 or last:
            val_loss = pipeline_evaluate(
                modules,
                data=data,
                cfg=cfg,
                rank=rank,
                stages=D,
                act_shape=(cfg.batch_size, *act_shape[1:]),
                device=device,
            )
            gathered: list[Any] = [None] * world
            dist.all_gather_object(gathered, {"timeline": rec.timeline, "peak_stash": rec.peak_stash})
            if lead:
                sink.metric(step, "val_loss", val_loss)
                event = timeline_event([g["timeline"] for g in gathered], sched=sched)
                event["step"] = step
                event["peak_stash_executed"] = [g["peak_stash"] for g in gathered]
                bubble = event["bubble_executed"]
                sink.event("timeline", event)
        if job.checkpoint_every and step % job.checkpoint_every == 0:
            p = save(step)
            if lead and p is not None:
                sink.event("checkpoint", {"step": step, "path": str(p.parent.parent)})
    if steps.ran > 0:
        save(steps.last)
    executor.close()
    # leave together: a rank that tears its process group down while a peer still talks to it
    # makes gloo abort that peer
    dist.barrier()
    result = run_summary(
        steps,
        final_loss=loss_value,
        val_loss=val_loss,
        params=n_params,
        tokens_per_step=tokens_per_step,
        device=device,
    ) | {
        "pipeline": {"schedule": pipe.schedule, "stages": D, "microbatches": N, "bubble_executed": bubble},
    }
    if lead:
        sink.result(result)
    return result
