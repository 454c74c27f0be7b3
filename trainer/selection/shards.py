"""One trial of a selection batch, cut into shards that a device runs one at a time.

The model is the trial's `nn.Sequential`, built on the host exactly as trainer/loop.py builds it;
its shards are contiguous slices of it cut by the spilling engine's partitioner
(trainer/spill/partition.py). Between tasks the host copy is the only copy: a task copies its shard
in, computes, and copies it back out, so the next shard of the trial may run on any device.

A mini-batch is forward shards 0..S-2 (no autograd graph kept; each saves its boundary input on the
host), then the last shard's forward and backward fused (its forward would only be recomputed), then
backward shards S-2..0, each recomputing its forward from the saved boundary input and stepping its
own optimizer. Per-shard optimizers update each parameter exactly as one optimizer over the model
does (SGD and AdamW act on each parameter alone); gradient clipping needs the global norm, so with
train.grad_clip > 0 every shard's step waits for the last backward shard.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from trainer.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from trainer.config import JobConfig
from trainer.data import BatchStream, TextData
from trainer.loop import build_optimizer, check_finite
from trainer.models import build_model, count_params, lm_loss
from trainer.spill.partition import (
    LayerCost,
    measure_layers,
    partition,
    prefetch_bytes,
    state_bytes_per_param,
    working_set,
)

_COSTS: dict[tuple[str, int, int], list[LayerCost]] = {}
"""Per-layer costs by (model config, batch size, optimizer state bytes per parameter)."""

FORWARD = "F"
LAST = "FB"
BACKWARD = "B"


@dataclass(kw_only=True, slots=True, frozen=True)
class Task:
    kind: str
    """F: forward of a shard that is not the last; FB: last shard forward+backward; B: backward."""
    shard: int


@dataclass(kw_only=True, slots=True)
class TaskTiming:
    compute_s: float = 0.0
    copy_s: float = 0.0


def mini_batch_tasks(n_shards: int) -> list[Task]:
    last = n_shards - 1
    return (
        [Task(kind=FORWARD, shard=k) for k in range(last)]
        + [Task(kind=LAST, shard=last)]
        + [Task(kind=BACKWARD, shard=k) for k in reversed(range(last))]
    )


def move_optimizer_state(opt: torch.optim.Optimizer, device: torch.device) -> None:
    for state in opt.state.values():
        for key, value in state.items():
            # AdamW keeps its step count as a CPU scalar unless capturable; leave it there
            if torch.is_tensor(value) and key != "step":
                state[key] = value.to(device, non_blocking=True)


@dataclass(kw_only=True, slots=True)
class ShardedTrial:
    index: int
    job: JobConfig
    model: nn.Sequential
    shards: list[nn.Sequential]
    bounds: list[tuple[int, int]]
    opts: list[torch.optim.Optimizer]
    work_bytes: list[int]
    """W(s): device bytes while shard s runs (partitioner's rule)."""
    copy_bytes: list[int]
    """Pf(s): device bytes a prefetched shard s holds before it runs."""
    data: TextData
    stream: BatchStream
    flops_per_step: float
    step: int = 0
    """Optimizer steps done."""
    tasks: list[Task] = field(default_factory=list)
    pos: int = 0
    """Position of the next task within the mini-batch."""
    loss: float = float("nan")
    _x: torch.Tensor | None = None
    _y: torch.Tensor | None = None
    _inputs: list[torch.Tensor | None] = field(default_factory=list)
    _grad_out: torch.Tensor | None = None
    _resident: int | None = None
    """Shard currently on the device (copied in by a prefetch or a task)."""

    @classmethod
    def build(cls, job: JobConfig, *, index: int, budget_bytes: int | None, prefetch: bool) -> ShardedTrial:
        """Cut the model so one shard's working set plus a prefetched shard of any other trial fit
        the device: with prefetch each shard gets half the budget (HYDRA's double buffer)."""
        cfg = job.train
        model = build_model(job.model, seed=cfg.seed)
        spill = job.parallel.spill
        if spill is not None:
            own = int(spill.device_budget_mb * 2**20)
            budget_bytes = own if budget_bytes is None else min(own, budget_bytes)
        state_bpp = state_bytes_per_param(optimizer=cfg.optimizer, momentum=cfg.momentum, offload=False)
        # trials of a search often share an architecture (only lr or seed differ): measure it once
        key = (repr(job.model), cfg.batch_size, state_bpp)
        costs = _COSTS.get(key)
        if costs is None:
            costs = _COSTS[key] = measure_layers(
                model,
                batch_size=cfg.batch_size,
                seq_len=job.model.seq_len,
                state_bpp=state_bpp,
                device="meta",
            )
        shard_budget = None if budget_bytes is None else (budget_bytes // 2 if prefetch else budget_bytes)
        plan = partition(
            costs,
            budget_bytes=shard_budget,
            prefetch=False,
            cuts=spill.cuts if spill is not None else None,
        )
        shards = [model[a:b] for a, b in plan.bounds]  # slices share the model's modules
        data = TextData.from_config(job.data, seq_len=job.model.seq_len)
        return cls(
            index=index,
            job=job,
            model=model,
            shards=shards,
            bounds=plan.bounds,
            opts=[build_optimizer(s.parameters(), cfg) for s in shards],
            work_bytes=[working_set(costs, start=a, stop=b) for a, b in plan.bounds],
            copy_bytes=[prefetch_bytes(costs, start=a, stop=b) for a, b in plan.bounds],
            data=data,
            stream=BatchStream(data=data, batch_size=cfg.batch_size, seed=cfg.seed),
            # 6 flops per parameter per token (forward + backward) plus the recompute (2 more)
            flops_per_step=8.0 * count_params(model) * cfg.batch_size * job.model.seq_len,
            tasks=mini_batch_tasks(len(shards)),
            _inputs=[None] * len(shards),
        )

    @property
    def steps_total(self) -> int:
        return self.job.train.steps

    @property
    def next_task(self) -> Task:
        return self.tasks[self.pos]

    # -- device residency ------------------------------------------------------------------------

    def copy_in(self, shard: int, device: torch.device) -> float:
        """Copy shard `shard` (parameters, gradients, optimizer state) to `device`; returns seconds.
        On a CUDA side stream this is the prefetch; on CPU it moves nothing."""
        t0 = time.perf_counter()
        self.shards[shard].to(device, non_blocking=True)
        move_optimizer_state(self.opts[shard], device)
        self._resident = shard
        return time.perf_counter() - t0

    def copy_out(self, shard: int) -> float:
        t0 = time.perf_counter()
        host = torch.device("cpu")
        self.shards[shard].to(host)
        move_optimizer_state(self.opts[shard], host)
        self._resident = None
        return time.perf_counter() - t0

    # -- one task --------------------------------------------------------------------------------

    def run_task(self, device: torch.device) -> TaskTiming:
        """Run the next task of the mini-batch on `device` and advance. Returns its timing."""
        task = self.next_task
        k = task.shard
        timing = TaskTiming()
        if self._resident != k:
            timing.copy_s += self.copy_in(k, device)
        sync = torch.cuda.synchronize if device.type == "cuda" else (lambda *_: None)
        t0 = time.perf_counter()
        if task.kind == FORWARD:
            if k == 0:
                self._x, self._y = self.stream.batch_for(self.step)
                self._inputs[0] = self._x
            with torch.no_grad():
                out = self.shards[k](self._inputs[k].to(device))
            self._inputs[k + 1] = out.to("cpu")
        else:
            if task.kind == LAST and k == 0:  # one shard: the whole model in one task
                self._x, self._y = self.stream.batch_for(self.step)
                self._inputs[0] = self._x
            inp = self._inputs[k].to(device)
            if k > 0:
                inp = inp.detach().requires_grad_(True)
            opt = self.opts[k]
            opt.zero_grad(set_to_none=True)
            out = self.shards[k](inp)
            if task.kind == LAST:
                loss = lm_loss(out, self._y.to(device))
                loss.backward()
                self.loss = loss.item()  # note: a CPU-GPU sync point, once per mini-batch
                check_finite(self.loss, self.step + 1)
            else:
                out.backward(self._grad_out.to(device))
            self._grad_out = inp.grad.to("cpu") if k > 0 else None
            self._inputs[k] = None
            if self.job.train.grad_clip == 0:
                opt.step()
            elif k == 0:
                self._clip_and_step_all()
        sync(device)
        timing.compute_s = time.perf_counter() - t0
        timing.copy_s += self.copy_out(k)
        self.pos += 1
        if self.pos == len(self.tasks):
            self.pos = 0
            self.step += 1
            self._x = self._y = self._grad_out = None
        return timing

    def _clip_and_step_all(self) -> None:
        # the global norm needs every shard's gradient, so the steps wait for the last backward shard;
        # the other shards' gradients are on the host, where their optimizer state is too
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.job.train.grad_clip)
        for opt in self.opts:
            opt.step()

    @torch.no_grad()
    def evaluate(self, device: torch.device) -> float:
        """The loop's validation loss (same fixed batches), computed shard by shard on `device`."""
        cfg = self.job.train
        g = torch.Generator().manual_seed(cfg.seed + 7919)
        batches = [
            self.data.batch(split="val", batch_size=cfg.batch_size, generator=g)
            for _ in range(cfg.eval_batches)
        ]
        hs = [x for x, _ in batches]
        self.model.eval()
        for k, shard in enumerate(self.shards):
            self.copy_in(k, device)
            hs = [shard(h.to(device)) for h in hs]
            self.copy_out(k)
        self.model.train()
        total = sum(lm_loss(h, y.to(device)).item() for h, (_, y) in zip(hs, batches, strict=True))
        return total / cfg.eval_batches

    # -- checkpoints -----------------------------------------------------------------------------

    def state(self) -> dict[str, Any]:
        return {"model": self.model.state_dict(), "optimizers": [o.state_dict() for o in self.opts]}

    def save(self, directory: Path) -> Path:
        return save_checkpoint(directory, step=self.step, state=self.state())

    def resume(self, directory: Path | None) -> int:
        """Continue from the latest checkpoint in `directory`, if any; returns the step."""
        path = latest_checkpoint(directory)
        if path is None:
            return self.step
        state = load_checkpoint(path)
        self.model.load_state_dict(state["model"])
        for opt, s in zip(self.opts, state["optimizers"], strict=True):
            opt.load_state_dict(s)
        self.step = int(state["step"])
        return self.step

    def warm_start(self, path: Path) -> None:
        """Start from another trial's weights (a checkpoint file or directory); fresh optimizer."""
        if path.is_dir():
            found = latest_checkpoint(path)
            if found is None:
                raise FileNotFoundError(f"no checkpoint in {path} to warm-start trial {self.index} from")
            path = found
        self.model.load_state_dict(load_checkpoint(path)["model"])
