"""The spilling engine as a trainer/loop.py Engine (trainer/runner.py picks it for `parallel.spill`,
and for `parallel.offload.optimizer` on one process). The one loop gives it the same data, metrics,
stop handling and checkpoint files as every engine; it adds the memory metrics `ledger_peak_mb` and
`resident_shards`.

Checkpoints use the composed engine's format ({"model": state_dict, "optimizer": torch optimizer state_dict})
with fp32 weights and AdamW/SGD state under torch's own keys, so a job can resume on either engine
and with different cuts; the spill-only extras (loss scale, cuts) ride under "spill".
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from jobrules.spec import JobSpec, TrainSpec
from trainer.data import data_for
from trainer.models import count_params
from trainer.optim import build_optimizer
from trainer.protocol import MetricsSink
from trainer.recipe import ModelRecipe, build_dense
from trainer.spill.engine import SpillEngine, default_bucket_numel
from trainer.spill.ledger import DeviceLedger, MiB, cuda_check
from trainer.spill.offload import DTYPES, bucket_bytes
from trainer.spill.partition import (
    DoesNotFit,
    SpillPlan,
    library_workspace_bytes,
    measure_layers,
    partition,
    state_bytes_per_param,
)


def trial_example(job: JobSpec, recipe: ModelRecipe) -> tuple[torch.Tensor, torch.Tensor]:
    """One batch as the recipe feeds it (a user model's inputs need not be token ids): what the
    cost trial runs, with the recipe's own loss."""
    g = torch.Generator().manual_seed(0)
    return recipe.feed(data_for(job).batch(split="val", batch_size=job.train.batch_size, generator=g))


def plan_job(
    job: JobSpec, model: nn.Sequential, *, device: torch.device, recipe: ModelRecipe
) -> tuple[SpillPlan, str]:
    """The shard plan for `job` and a line saying how it was made. Costs are measured by a trial
    pass of the recipe's own batch and loss, on CUDA, and estimated on the meta device elsewhere.
    When the budget fits one shard at a time but not with the prefetched neighbour, prefetch is
    turned off rather than the job refused (the REST layer's rule is the single-layer one). On CUDA
    the budget also holds the math libraries' workspaces, measured here (the REST layer cannot
    know the GPU, so a budget it accepts can still be refused here, with the numbers)."""
    spill, off = job.parallel.spill, job.parallel.offload
    reserved = library_workspace_bytes(device) if spill is not None else 0
    offloaded = off is not None and off.optimizer
    on_host = job.parallel.spill_state_on_host
    costs = measure_layers(
        model,
        batch_size=job.train.batch_size,
        seq_len=job.model.seq_len,
        param_dtype=DTYPES[off.dtype] if offloaded else torch.float32,
        state_bpp=state_bytes_per_param(
            optimizer=job.train.optimizer, momentum=job.train.momentum, offload=offloaded or on_host
        ),
        device=device if device.type == "cuda" else "meta",
        example=trial_example(job, recipe),
        loss_fn=recipe.loss,
    )
    extra = bucket_bytes(default_bucket_numel(model)) if offloaded else 0
    budget = int(spill.device_budget_mb * MiB) if spill is not None else None
    prefetch = spill.prefetch if spill is not None else False
    cuts = spill.cuts if spill is not None else None
    how = "measured on " + str(device) if device.type == "cuda" else "estimated on meta"
    try:
        plan = partition(
            costs,
            budget_bytes=budget,
            prefetch=prefetch,
            cuts=cuts,
            extra_bytes=extra,
            reserved_bytes=reserved,
        )
        return plan, how
    except DoesNotFit as e:
        if not prefetch or cuts is not None:
            raise
        plan = partition(
            costs, budget_bytes=budget, prefetch=False, cuts=None, extra_bytes=extra, reserved_bytes=reserved
        )
        return plan, f"{how}; prefetch turned off ({e})"


def to_torch_optimizer_state(
    per_param: dict[str, dict[str, Any]], *, model: nn.Module, cfg: TrainSpec
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


class SpilledEngine:
    """The spilling engine (with or without the offloaded optimizer) behind trainer/loop.py's
    Engine interface. Single process: the whole model lives in host memory (HYDRA's premise) and
    only the running shard, plus the prefetched next one, on the device."""

    checkpoint_subdir: str | None = None
    writes_checkpoints = True

    def __init__(self, job: JobSpec, *, recipe: ModelRecipe, sink: MetricsSink, device: torch.device) -> None:
        cfg = job.train
        self.job, self.device = job, device
        self.model = build_dense(recipe, seed=cfg.seed)
        self.n_params = count_params(self.model)
        self.plan, self.how = plan_job(job, self.model, device=device, recipe=recipe)
        # the allocator's baseline leaves out the workspaces the plan measured (and reserves in the
        # ledger): they are the run's, so its allocator peak counts them too. Read after the plan,
        # which cleared those the process held before (an earlier run's), and made this run's.
        self.base = (
            torch.cuda.memory_allocated(device) - self.plan.reserved_bytes if device.type == "cuda" else 0
        )
        spill = job.parallel.spill
        self.ledger = DeviceLedger(
            budget_bytes=int(spill.device_budget_mb * MiB) if spill is not None else None
        )
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)  # the cost trial's own peak is not the run's
        self.engine = SpillEngine(
            self.model,
            plan=self.plan,
            train=cfg,
            device=device,
            ledger=self.ledger,
            prefetch=self.plan.prefetch,
            offload=job.parallel.offload,
            loss_fn=recipe.loss,
            host_step=job.parallel.spill_state_on_host,
        )
        off = job.parallel.offload
        self.shard_info = {
            "shards": self.plan.n_shards,
            "cuts": self.plan.cuts,
            "planned_peak_mb": self.plan.peak_bytes / MiB,
            "budget_mb": spill.device_budget_mb if spill is not None else None,
            "workspace_mb": self.plan.reserved_bytes / MiB,
            "prefetch": self.plan.prefetch,
            "offload": off.dtype if self.engine.offloaded and off else None,
            "optimizer_on": "host" if self.engine.host is not None else "device",
            "shard0_steps_on_device": self.engine.host is None or self.engine.anchor,
        }

    def train_step(self, inputs: torch.Tensor, targets: torch.Tensor) -> float:
        return self.engine.train_step(inputs, targets)

    def eval_loss(self, inputs: torch.Tensor, targets: torch.Tensor) -> float:
        return self.engine.eval_loss(inputs, targets)

    def step_metrics(self) -> dict[str, float]:
        return {"ledger_peak_mb": self.ledger.step_peak / MiB, "resident_shards": self.ledger.resident_peak}

    def eval_report(self, step: int, sink: MetricsSink) -> None:
        pass

    def state_dict(self) -> dict[str, Any]:
        """The composed engine's format: fp32 weights and torch optimizer state under torch's own keys, so
        a job resumes on either engine; loss scale and cuts ride under "spill"."""
        sd = self.engine.state_dict()
        optim = to_torch_optimizer_state(sd["optimizer"]["per_param"], model=self.model, cfg=self.job.train)
        extra: dict[str, Any] = {"cuts": self.plan.cuts}
        if "loss_scale" in sd["optimizer"]:
            extra["loss_scale"] = sd["optimizer"]["loss_scale"]
        return {"model": sd["model"], "optimizer": optim, "spill": extra}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        extra = state.get("spill", {})
        self.engine.load_state_dict(
            {
                "model": state["model"],
                "optimizer": {
                    "per_param": from_torch_optimizer_state(state["optimizer"], model=self.model),
                    **({"loss_scale": extra["loss_scale"]} if "loss_scale" in extra else {}),
                },
            }
        )

    def describe(self) -> str:
        p = self.plan
        reserved = f", {p.reserved_bytes / MiB:.3f} MiB of it library workspaces" if p.reserved_bytes else ""
        return f"{p.n_shards} shards (cuts {p.cuts}), planned peak {p.peak_bytes / MiB:.3f} MiB{reserved} ({self.how})"

    def start_info(self) -> dict[str, Any]:
        return dict(self.shard_info)

    def summary(self, *, steps_ran: int, sink: MetricsSink) -> dict[str, Any]:
        out: dict[str, Any] = {**self.shard_info, "ledger_peak_mb": self.ledger.peak / MiB}
        if self.device.type == "cuda":
            # the ledger beside the allocator: what the engine does not hold (autograd transients,
            # workspaces, allocator rounding) shows up as untracked_mb
            out.update(cuda_check(self.ledger, device=self.device, baseline_bytes=self.base))
        if self.engine.opt is not None:
            out["loss_scale"] = self.engine.opt.scaler.scale
            out["skipped_steps"] = self.engine.opt.scaler.skipped_steps
        return out

    def close(self) -> None:
        self.engine.close()
