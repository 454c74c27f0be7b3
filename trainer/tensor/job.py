"""Training entry point for tensor-parallel jobs (called by trainer/runner.py under torchrun).

Order of set-up: layout checks (no process group yet), then the process group and the mesh, then the
dense model from the job's seed on every rank, cut into this rank's shards. Embedding, every block
and the head are all sharded (see block.py); nothing stays replicated except what the layout itself
replicates (1d layer norms, row-parallel biases and the position table).

Every rank draws step k's global batch from BatchStream.batch_for(k) and keeps its share (all of it
for 1d, block k*q+i of d*q for the grid), so the run sees exactly the data of trainer.loop.train.
Checkpoints are per rank (each rank's shards and optimizer state) under checkpoint_dir/tp-rankNNN.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from trainer.checkpoint import save_checkpoint
from trainer.config import ConfigError, JobConfig, TrainConfig
from trainer.data import BatchStream, Dataset, data_for
from trainer.device import pick_device
from trainer.distributed import env_world_size, init_from_env
from trainer.loop import StepRange, build_optimizer, check_finite, report_step, resume, run_summary
from trainer.models import build_model
from trainer.protocol import MetricsSink, NullSink, StopSignal
from trainer.tensor import comm
from trainer.tensor.block import clip_grad_norm, global_loss, local_batch, loss_fn, shard_model
from trainer.tensor.mesh import Mesh1D, TensorMesh, check_tensor_layout, grid_mesh_from_config


@torch.no_grad()
def evaluate_tp(
    model: torch.nn.Module, data: Dataset, *, cfg: TrainConfig, mesh: TensorMesh, device: torch.device
) -> float:
    """The validation batches of trainer.loop.evaluate, through the sharded model."""
    was_training = model.training
    model.eval()
    g = torch.Generator().manual_seed(cfg.seed + 7919)
    total = 0.0
    with comm.paused():
        for _ in range(cfg.eval_batches):
            x, y = data.batch(split="val", batch_size=cfg.batch_size, generator=g)
            logits = model(local_batch(x, mesh=mesh).to(device))
            local = loss_fn(
                logits, local_batch(y, mesh=mesh).to(device), mesh=mesh, global_rows=cfg.batch_size
            )
            total += global_loss(local, mesh=mesh)
    model.train(was_training)
    return total / cfg.eval_batches


def comm_summary(*, mesh: TensorMesh, steps: int) -> dict[str, Any]:
    """This run's ledger: per rank totals (gathered from every rank), rank 0's per-layer and per-op
    breakdown, and the per-step averages."""
    mine = comm.LEDGER.total()
    fwd, bwd = comm.LEDGER.total(phase="fwd"), comm.LEDGER.total(phase="bwd")
    row = {"total": mine.as_dict(), "fwd": fwd.as_dict(), "bwd": bwd.as_dict()}
    per_rank: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(per_rank, row)
    q = mesh.size if isinstance(mesh, Mesh1D) else mesh.q
    return {
        "mode": mesh.mode,
        "world_size": dist.get_world_size(),
        "q": None if isinstance(mesh, Mesh1D) else q,
        "d": None if isinstance(mesh, Mesh1D) else mesh.d,
        "steps": steps,
        "per_rank": per_rank,
        "sent_bytes_per_step_rank0": (mine.as_dict()["sent_bytes"] / steps) if steps else 0.0,
        "calls_per_step_rank0": (mine.calls / steps) if steps else 0.0,
        "by_layer_rank0": comm.LEDGER.by_layer(),
        "by_op_rank0": comm.LEDGER.by_op(),
    }


def train_tensor(
    job: JobConfig, *, sink: MetricsSink, stop: StopSignal, checkpoint_dir: Path | None = None
) -> dict[str, Any]:
    tensor = job.parallel.tensor
    if tensor is None:
        raise ConfigError("train_tensor needs parallel.tensor")
    if job.parallel.data_parallel != 1:
        raise ConfigError(
            f"parallel.data_parallel ({job.parallel.data_parallel}) > 1 with tensor parallelism is not "
            "supported yet"
        )
    cfg = job.train
    world = dist.get_world_size() if dist.is_initialized() else env_world_size()
    # every rule the layers rely on, before any process group exists (a bad shape fails fast)
    check_tensor_layout(tensor, world_size=world, model=job.model, batch_size=cfg.batch_size)
    want = job.resources.device
    device_type = "cuda" if want == "cuda" or (want == "auto" and torch.cuda.is_available()) else "cpu"
    # join first: on GPUs init_from_env selects this rank's device (LOCAL_RANK), which pick_device reads
    init_from_env(device_type=device_type)
    device = pick_device(want)
    rank = dist.get_rank()
    if rank != 0:
        sink = NullSink()
    mesh = grid_mesh_from_config(tensor, device_type=device.type)

    dense = build_model(job.model, seed=cfg.seed)
    n_params = sum(p.numel() for p in dense.parameters())
    model = shard_model(dense, mesh=mesh).to(device)
    del dense
    opt = build_optimizer(model.parameters(), cfg)
    data = data_for(job)
    stream = BatchStream(data=data, batch_size=cfg.batch_size, seed=cfg.seed)
    my_dir = checkpoint_dir / f"tp-rank{rank:03d}" if checkpoint_dir is not None else None

    start = resume(my_dir, model=model, opt=opt, sink=sink)
    local_params = sum(p.numel() for p in model.parameters())
    sink.log(
        f"model {job.model.kind}: {n_params:,} parameters, tensor {tensor.mode} on {world} ranks "
        f"({local_params:,} on rank 0) on {device}"
    )
    sink.event(
        "start",
        {
            "params": n_params,
            "params_rank0": local_params,
            "device": str(device),
            "start_step": start,
            "tensor": {"mode": tensor.mode, "size": tensor.size, "q": tensor.q, "d": tensor.d},
        },
    )

    comm.LEDGER.reset()
    comm.LEDGER.enabled = True
    tokens_per_step = cfg.batch_size * job.model.seq_len
    loss_value = val_loss = float("nan")
    steps = StepRange(start=start, end=cfg.steps, stop=stop)
    for step in steps:
        t0 = time.perf_counter()
        x, y = stream.batch_for(step - 1)
        logits = model(local_batch(x, mesh=mesh).to(device))
        loss = loss_fn(logits, local_batch(y, mesh=mesh).to(device), mesh=mesh, global_rows=cfg.batch_size)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if cfg.grad_clip > 0:
            clip_grad_norm(list(model.parameters()), max_norm=cfg.grad_clip, group=dist.group.WORLD)
        opt.step()
        loss_value = global_loss(loss, mesh=mesh)  # note: a sync point, once per step
        check_finite(loss_value, step)
        dt = time.perf_counter() - t0
        report_step(sink, step=step, loss=loss_value, seconds=dt, tokens=tokens_per_step, device=device)
        if step % cfg.eval_every == 0 or step == cfg.steps:
            val_loss = evaluate_tp(model, data, cfg=cfg, mesh=mesh, device=device)
            sink.metric(step, "val_loss", val_loss)
        if my_dir is not None and job.checkpoint_every and step % job.checkpoint_every == 0:
            p = save_checkpoint(
                my_dir, step=step, state={"model": model.state_dict(), "optimizer": opt.state_dict()}
            )
            sink.event("checkpoint", {"step": step, "path": str(p)})

    if my_dir is not None and steps.ran > 0:
        save_checkpoint(
            my_dir, step=steps.last, state={"model": model.state_dict(), "optimizer": opt.state_dict()}
        )
    with comm.paused():
        summary = comm_summary(mesh=mesh, steps=steps.ran)
    sink.event("comm", summary)
    result = run_summary(
        steps,
        final_loss=loss_value,
        val_loss=val_loss,
        params=n_params,
        tokens_per_step=tokens_per_step,
        device=device,
    ) | {
        "params_rank0": local_params,
        "tensor": {"mode": tensor.mode, "world_size": world},
        "comm_sent_bytes_per_step_rank0": summary["sent_bytes_per_step_rank0"],
    }
    sink.result(result)
    return result
