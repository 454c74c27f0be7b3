"""A training job on the spilling engine (called by trainer/runner.py for `parallel.spill` or
`parallel.offload.optimizer`). Same data, metrics, stop handling and checkpoint files as
trainer/loop.py's `train`, plus the memory metrics `ledger_peak_mb` and `resident_shards`.

Checkpoints use loop.train's format ({"model": state_dict, "optimizer": torch optimizer state_dict})
with fp32 weights and AdamW/SGD state under torch's own keys, so a job can resume on either engine
and with different cuts; the spill-only extras (loss scale, cuts) ride under "spill".
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from trainer.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from trainer.config import JobConfig, TrainConfig
from trainer.data import BatchStream, Dataset, data_for
from trainer.device import pick_device
from trainer.loop import StepRange, build_optimizer, check_finite, report_step, run_summary
from trainer.models import build_model, count_params
from trainer.protocol import MetricsSink, StopSignal
from trainer.spill.engine import SpillEngine, default_bucket_numel
from trainer.spill.ledger import DeviceLedger, MiB, cuda_check
from trainer.spill.offload import DTYPES, bucket_bytes
from trainer.spill.partition import DoesNotFit, SpillPlan, measure_layers, partition, state_bytes_per_param


def plan_job(job: JobConfig, model: nn.Sequential, *, device: torch.device) -> tuple[SpillPlan, str]:
    """The shard plan for `job` and a line saying how it was made. Costs are measured by a trial
    pass on CUDA and estimated on the meta device elsewhere. When the budget fits one shard at a
    time but not with the prefetched neighbour, prefetch is turned off rather than the job refused
    (the REST layer's rule is the single-layer one)."""
    spill, off = job.parallel.spill, job.parallel.offload
    offloaded = off is not None and off.optimizer
    costs = measure_layers(
        model,
        batch_size=job.train.batch_size,
        seq_len=job.model.seq_len,
        param_dtype=DTYPES[off.dtype] if offloaded else torch.float32,
        state_bpp=state_bytes_per_param(
            optimizer=job.train.optimizer, momentum=job.train.momentum, offload=offloaded
        ),
        device=device if device.type == "cuda" else "meta",
    )
    extra = bucket_bytes(default_bucket_numel(model)) if offloaded else 0
    budget = int(spill.device_budget_mb * MiB) if spill is not None else None
    prefetch = spill.prefetch if spill is not None else False
    cuts = spill.cuts if spill is not None else None
    how = "measured on " + str(device) if device.type == "cuda" else "estimated on meta"
    try:
        return partition(costs, budget_bytes=budget, prefetch=prefetch, cuts=cuts, extra_bytes=extra), how
    except DoesNotFit as e:
        if not prefetch or cuts is not None:
            raise
        plan = partition(costs, budget_bytes=budget, prefetch=False, cuts=None, extra_bytes=extra)
        return plan, f"{how}; prefetch turned off ({e})"


def to_torch_optimizer_state(
    per_param: dict[str, dict[str, Any]], *, model: nn.Module, cfg: TrainConfig
) -> dict[str, Any]:
    """Per-name optimizer state as a torch optimizer state_dict over `model.parameters()`."""
    template = build_optimizer(model.parameters(), cfg).state_dict()
    names = [n for n, _ in model.named_parameters()]
    state: dict[int, dict[str, Any]] = {}
    for i, name in enumerate(names):
        st = dict(per_param.get(name, {}))
        if not st:
            continue
        if "step" in st:
            st["step"] = torch.tensor(float(st["step"]), dtype=torch.float32)
        shape = dict(model.named_parameters())[name].shape
        state[i] = {
            k: (v.reshape(shape) if isinstance(v, torch.Tensor) and v.dim() else v) for k, v in st.items()
        }
    return {"state": state, "param_groups": template["param_groups"]}


def from_torch_optimizer_state(sd: dict[str, Any], *, model: nn.Module) -> dict[str, dict[str, Any]]:
    names = [n for n, _ in model.named_parameters()]
    out: dict[str, dict[str, Any]] = {}
    for i, st in sd["state"].items():
        out[names[int(i)]] = {k: (float(v) if k == "step" else v) for k, v in st.items() if v is not None}
    return out


def train_spilled(
    job: JobConfig,
    *,
    sink: MetricsSink,
    stop: StopSignal,
    checkpoint_dir: Path | None = None,
    device: torch.device | None = None,
) -> dict[str, Any]:
    cfg = job.train
    device = device or pick_device(job.resources.device)
    model = build_model(job.model, seed=cfg.seed)
    plan, how = plan_job(job, model, device=device)
    spill = job.parallel.spill
    budget = int(spill.device_budget_mb * MiB) if spill is not None else None
    ledger = DeviceLedger(budget_bytes=budget)
    base = 0
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
    engine = SpillEngine(
        model,
        plan=plan,
        train=cfg,
        device=device,
        ledger=ledger,
        prefetch=plan.prefetch,
        offload=job.parallel.offload,
    )
    data = data_for(job)
    stream = BatchStream(data=data, batch_size=cfg.batch_size, seed=cfg.seed)

    start = 0
    if (path := latest_checkpoint(checkpoint_dir)) is not None:
        state = load_checkpoint(path)
        extra = state.get("spill", {})
        engine.load_state_dict(
            {
                "model": state["model"],
                "optimizer": {
                    "per_param": from_torch_optimizer_state(state["optimizer"], model=model),
                    **({"loss_scale": extra["loss_scale"]} if "loss_scale" in extra else {}),
                },
            }
        )
        start = int(state["step"])
        sink.log(f"resumed from {path.name} at step {start}")
    n_params = count_params(model)
    shard_info = {
        "shards": plan.n_shards,
        "cuts": plan.cuts,
        "planned_peak_mb": plan.peak_bytes / MiB,
        "budget_mb": spill.device_budget_mb if spill is not None else None,
        "prefetch": plan.prefetch,
        "offload": job.parallel.offload.dtype if engine.offloaded and job.parallel.offload else None,
    }
    sink.log(
        f"model {job.model.kind}: {n_params:,} parameters on {device}, {plan.n_shards} shards "
        f"(cuts {plan.cuts}), planned peak {plan.peak_bytes / MiB:.3f} MiB ({how})"
    )
    sink.event("start", {"params": n_params, "device": str(device), "start_step": start, **shard_info})

    def save(step: int) -> Path:
        sd = engine.state_dict()
        optim = to_torch_optimizer_state(sd["optimizer"]["per_param"], model=model, cfg=cfg)
        spill_extra: dict[str, Any] = {"cuts": plan.cuts}
        if "loss_scale" in sd["optimizer"]:
            spill_extra["loss_scale"] = sd["optimizer"]["loss_scale"]
        return save_checkpoint(
            checkpoint_dir, step=step, state={"model": sd["model"], "optimizer": optim, "spill": spill_extra}
        )

    tokens_per_step = cfg.batch_size * job.model.seq_len
    loss_value = val_loss = float("nan")
    steps = StepRange(start=start, end=cfg.steps, stop=stop)
    for step in steps:
        t0 = time.perf_counter()
        x, y = stream.batch_for(step - 1)
        loss_value = engine.train_step(x, y)
        check_finite(loss_value, step)
        dt = time.perf_counter() - t0
        report_step(sink, step=step, loss=loss_value, seconds=dt, tokens=tokens_per_step, device=device)
        sink.metric(step, "ledger_peak_mb", ledger.step_peak / MiB)
        sink.metric(step, "resident_shards", ledger.resident_peak)
        if step % cfg.eval_every == 0 or step == cfg.steps:
            val_loss = evaluate(engine, data, cfg=cfg)
            sink.metric(step, "val_loss", val_loss)
        if checkpoint_dir is not None and job.checkpoint_every and step % job.checkpoint_every == 0:
            p = save(step)
            sink.event("checkpoint", {"step": step, "path": str(p)})

    if checkpoint_dir is not None and steps.ran > 0:
        save(steps.last)
    result = run_summary(
        steps,
        final_loss=loss_value,
        val_loss=val_loss,
        params=n_params,
        tokens_per_step=tokens_per_step,
        device=device,
    ) | {
        **shard_info,
        "ledger_peak_mb": ledger.peak / MiB,
    }
    if device.type == "cuda":
        # the ledger beside the allocator: what the engine does not hold (autograd transients,
        # workspaces, allocator rounding) shows up as untracked_mb
        result.update(cuda_check(ledger, device=device, baseline_bytes=base))
    if engine.opt is not None:
        result["loss_scale"] = engine.opt.scaler.scale
        result["skipped_steps"] = engine.opt.scaler.skipped_steps
    engine.release()
    sink.result(result)
    return result


def evaluate(engine: SpillEngine, data: Dataset, *, cfg: TrainConfig) -> float:
    """The same fixed validation batches as trainer/loop.py's `evaluate`."""
    g = torch.Generator().manual_seed(cfg.seed + 7919)
    total = 0.0
    for _ in range(cfg.eval_batches):
        x, y = data.batch(split="val", batch_size=cfg.batch_size, generator=g)
        total += engine.eval_loss(x, y)
    return total / cfg.eval_batches
