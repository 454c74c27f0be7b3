"""One trial of a selection batch, cut into shards that any device runs one task at a time.

The model is the trial's `nn.Sequential`, built on the host exactly as trainer/loop.py builds it.
It is cut by the spilling engine's partitioner (trainer/spill/partition.py) and each piece is a
spilling-engine `Shard` (trainer/spill/shard.py): a flat fp32 host copy that is the truth while the
shard is spilled, a device copy while it runs, optimizer state moved with it. Between tasks every
shard of the trial is spilled, so the trial's next task may run on any device: a task rebinds the
shard to that device (its copy stream and its ledger) and copies it in.

A mini-batch is forward shards 0..K-2 (no autograd graph; each boundary output goes to the host),
then the last shard's forward, loss, backward and step in one task (its forward would only be
recomputed), then backward shards K-2..0, each recomputing its forward from the saved boundary
input and stepping its own optimizer at once, as in the spilling engine. Per-shard SGD and AdamW
steps are exactly the whole-model steps. Global-norm gradient clipping needs every gradient before
any step: with more than one shard the backward tasks park their gradients on the host (with their
per-parameter norms), and K step tasks follow, each bringing a shard back with its gradients to
scale and step it (the spilling engine's deferred path, one task per shard here).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from jobrules.spec import HOST_STEPS_IN_A_BATCH, JobSpec, SpecError
from trainer.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from trainer.data import BatchStream, Dataset, data_for, with_data_vocab
from trainer.loop import check_finite, val_batches
from trainer.models import count_params, recipe_for
from trainer.optim import build_optimizer
from trainer.recipe import ModelRecipe, build_dense
from trainer.spill.job import trial_example
from trainer.spill.ledger import DeviceLedger
from trainer.spill.partition import (
    LayerCost,
    measure_layers,
    partition,
    prefetch_bytes,
    state_bytes_per_param,
    working_set,
)
from trainer.spill.shard import Shard

_COSTS: dict[tuple[str, str, int, int], list[LayerCost]] = {}
"""Per-layer costs by (model config, data config, batch size, optimizer state bytes per parameter)."""

FORWARD = "F"
LAST = "FB"
STEP = "S"
BACKWARD = "B"
HOST = torch.device("cpu")


@dataclass(kw_only=True, slots=True, frozen=True)
class Task:
    kind: str
    """F: forward of a shard that is not the last; FB: last shard forward+backward; B: backward;
    S: deferred (clipped) optimizer step."""
    shard: int

    @property
    def steps(self) -> bool:
        """The task runs an optimizer step, so the shard's optimizer state comes in with it."""
        return self.kind != FORWARD


@dataclass(kw_only=True, slots=True)
class TaskTiming:
    compute_s: float = 0.0
    copy_s: float = 0.0


@dataclass(kw_only=True, slots=True, frozen=True)
class Place:
    """Where a task runs: the device, its ledger of real bytes, its copy stream (CUDA only)."""

    device: torch.device
    ledger: DeviceLedger
    stream: torch.cuda.Stream | None = None


class HostShard(Shard):
    """A spilling-engine shard that, while it runs on a CPU "device", computes on its host copy:
    host and device are the same memory there, so copying in and out would only cost time. An
    aliased shard's parameters and optimizer state stay bound to the host buffers for good (nothing
    is rebound in or out), and parked gradients are the gradient buffer itself."""

    alias = False
    """Set while the shard is bound to a CPU place: a copy in returns the host tensor itself."""

    def _copy_in(self, src: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        if self.alias and src.dtype == dtype:
            return src
        return super()._copy_in(src, dtype)

    def _copy_out(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        if src.data_ptr() == dst.data_ptr():  # an aliased shard writes its host copy in place
            return
        super()._copy_out(src, dst)

    def ready(self) -> None:
        if not self.alias:
            super().ready()
            return
        # parameters and optimizer state already point into the host buffers (spill left them
        # there): only gradients brought back for a deferred step need binding
        assert self.dev is self.host, f"shard {self.index} is not on the device"
        self._pending.clear()
        if self.dev_grad is not None:
            for p, view in zip(self.params, self.views(self.dev_grad), strict=True):
                p.grad = view

    def spill(self) -> None:
        if not self.alias:
            super().spill()
            return
        self.drop_grads()
        if self.state_dev is not None:
            self.state_dev = None
            self.ledger.release(f"{self.tag}.state")
        if self.dev is not None:
            self.dev, self.dirty = None, False
            self.ledger.release(f"{self.tag}.params")

    def stash_grads(self) -> None:
        if not self.alias:
            super().stash_grads()
            return
        assert self.dev_grad is not None
        self.grad_host = self.dev_grad  # the same memory: keep the buffer, free only its ledger entry
        self.drop_grads()


def mini_batch_tasks(n_shards: int, *, deferred: bool) -> list[Task]:
    last = n_shards - 1
    return (
        [Task(kind=FORWARD, shard=k) for k in range(last)]
        + [Task(kind=LAST, shard=last)]
        + [Task(kind=BACKWARD, shard=k) for k in reversed(range(last))]
        + ([Task(kind=STEP, shard=k) for k in range(n_shards)] if deferred else [])
    )


def _sync(place: Place) -> None:
    if place.device.type == "cuda":
        # note: a sync point per task, so the measured time is the shard's and the host copies
        # written by a spill are complete before another device reads them
        torch.cuda.synchronize(place.device)


@dataclass(kw_only=True, slots=True)
class ShardedTrial:
    index: int
    job: JobSpec
    recipe: ModelRecipe
    """The model's recipe: its loss and how a batch feeds it, as in every engine."""
    model: nn.Sequential
    shards: list[HostShard]
    work_bytes: list[int]
    """W(s): device bytes while shard s runs (the partitioner's rule)."""
    copy_bytes: list[int]
    """Pf(s): device bytes a prefetched shard s holds before it runs."""
    data: Dataset
    stream: BatchStream
    flops_per_step: float
    step: int = 0
    """Optimizer steps done."""
    tasks: list[Task] = field(default_factory=list)
    pos: int = 0
    """Position of the next task within the mini-batch."""
    loss: float = float("nan")
    _y: torch.Tensor | None = None
    _inputs: dict[int, torch.Tensor] = field(default_factory=dict)
    """Host copies of the boundary inputs the backward will recompute from."""
    _grad: torch.Tensor | None = None
    """Host copy of the gradient flowing down to the next backward shard."""
    _norms: dict[int, list[torch.Tensor]] = field(default_factory=dict)
    """Deferred path: per-parameter gradient norms of each shard, on the host."""
    _coef: torch.Tensor | None = None
    """Deferred path: the clip coefficient, once every shard's norms are in."""

    @classmethod
    def build(cls, job: JobSpec, *, index: int, budget_bytes: int | None, prefetch: bool) -> ShardedTrial:
        """Cut the model so that one shard's working set plus a prefetched shard of any other trial
        fit the device: with prefetch each shard gets half the budget (HYDRA's double buffer)."""
        job = with_data_vocab(job)
        cfg = job.train
        recipe = recipe_for(job.model)
        model = build_dense(recipe, seed=cfg.seed)
        spill = job.parallel.spill
        if spill is not None and spill.optimizer == "host":
            raise SpecError(HOST_STEPS_IN_A_BATCH)
        if spill is not None:
            own = int(spill.device_budget_mb * 2**20)
            budget_bytes = own if budget_bytes is None else min(own, budget_bytes)
        state_bpp = state_bytes_per_param(optimizer=cfg.optimizer, momentum=cfg.momentum, offload=False)
        # trials of a search often share an architecture (only lr or seed differ): measure it once
        key = (repr(job.model), repr(job.data), cfg.batch_size, state_bpp)
        costs = _COSTS.get(key)
        if costs is None:
            # the recipe's own batch and loss, as the spilling engine sizes (trainer/spill/job.py)
            example = trial_example(job, recipe)
            costs = _COSTS[key] = measure_layers(
                model,
                batch_size=cfg.batch_size,
                seq_len=job.model.seq_len,
                state_bpp=state_bpp,
                device="meta",
                example=example,
                loss_fn=recipe.loss,
            )
        shard_budget = None if budget_bytes is None else (budget_bytes // 2 if prefetch else budget_bytes)
        plan = partition(
            costs, budget_bytes=shard_budget, prefetch=False, cuts=spill.cuts if spill is not None else None
        )
        keys = ["exp_avg", "exp_avg_sq"] if cfg.optimizer == "adamw" else []
        if cfg.optimizer == "sgd" and cfg.momentum > 0:
            keys = ["momentum_buffer"]
        # a stand-in ledger: copy_in binds a shard to its place's ledger
        shards = HostShard.cut(
            model, plan.bounds, device=HOST, param_dtype=torch.float32, ledger=DeviceLedger()
        )
        for s in shards:
            s.tag = f"t{index}.s{s.index}"  # one device ledger holds several trials' shards
            s.attach_optimizer(build_optimizer(s.params, cfg), state_keys=keys)
        data = data_for(job)
        return cls(
            index=index,
            job=job,
            recipe=recipe,
            model=model,
            shards=shards,
            work_bytes=[working_set(costs, start=a, stop=b) for a, b in plan.bounds],
            copy_bytes=[prefetch_bytes(costs, start=a, stop=b) for a, b in plan.bounds],
            data=data,
            stream=BatchStream(data=data, batch_size=cfg.batch_size, seed=cfg.seed),
            # 6 flops per parameter per token (forward + backward) plus the recompute (2 more)
            flops_per_step=8.0 * count_params(model) * cfg.batch_size * job.model.seq_len,
            tasks=mini_batch_tasks(len(shards), deferred=len(shards) > 1 and cfg.grad_clip > 0),
        )

    @property
    def steps_total(self) -> int:
        return self.job.train.steps

    @property
    def next_task(self) -> Task:
        return self.tasks[self.pos]

    # -- device residency ------------------------------------------------------------------------

    @property
    def deferred(self) -> bool:
        return self.tasks[-1].kind == STEP

    def copy_in(self, k: int, place: Place, *, state: bool, grads: bool = False) -> float:
        """Bind shard k to `place` and start copying it in (on the copy stream on CUDA: this is the
        prefetch). Returns the seconds spent issuing it."""
        t0 = time.perf_counter()
        s = self.shards[k]
        if not s.resident:
            s.device, s.ledger, s.copy_stream = place.device, place.ledger, place.stream
            s.alias = place.device.type == HOST.type
        s.to_device(state=state, grads=grads)
        return time.perf_counter() - t0

    def _hold(self, place: Place, name: str, x: torch.Tensor) -> torch.Tensor:
        place.ledger.hold(f"t{self.index}.{name}", x.numel() * x.element_size())
        return x.to(place.device)

    # -- one task --------------------------------------------------------------------------------

    def run_task(self, place: Place) -> TaskTiming:
        """Run the next task of the mini-batch at `place`, spill the shard, and advance."""
        task = self.next_task
        k = task.shard
        s = self.shards[k]
        timing = TaskTiming(copy_s=self.copy_in(k, place, state=task.steps, grads=task.kind == STEP))
        t0 = time.perf_counter()
        s.ready()
        if task.kind == STEP:
            assert self._coef is not None and s.dev_grad is not None
            s.dev_grad.mul_(self._coef.to(place.device))
            s.step()
            s.drop_grads()
        else:
            self._compute(task, s, place)
        _sync(place)
        timing.compute_s = time.perf_counter() - t0
        t1 = time.perf_counter()
        s.spill()
        _sync(place)
        timing.copy_s += time.perf_counter() - t1
        self.pos += 1
        if self.pos == len(self.tasks):
            self.pos = 0
            self.step += 1
            self._y = self._grad = self._coef = None
            self._inputs.clear()
            self._norms.clear()
        return timing

    def _compute(self, task: Task, s: Shard, place: Place) -> None:
        k = task.shard
        if k == 0 and task.kind != BACKWARD:  # the mini-batch starts: step k's batch, as the loop
            x, self._y = self.recipe.feed(self.stream.batch_for(self.step))
            self._inputs[0] = x
        h = self._hold(place, "in", self._inputs[k])
        if task.kind == FORWARD:
            self._inputs[k + 1] = s.forward(h).to(HOST)
        else:
            if task.kind == LAST:
                y = self._hold(place, "target", self._y)
                grad, loss = s.backward(h, target=y, loss_fn=self.recipe.loss)
                self.loss = float(loss.item())  # note: a CPU-GPU sync point, once per mini-batch
                check_finite(self.loss, self.step + 1)
            else:
                g = self._hold(place, "grad", self._grad)
                grad, _ = s.backward(h, grad_out=g)
                place.ledger.release(f"t{self.index}.grad")
            self._grad = None if grad is None else grad.to(HOST)
            del self._inputs[k]
            clip = self.job.train.grad_clip
            if self.deferred:
                # park the gradients; the step tasks scale them by the global clip coefficient
                assert s.dev_grad is not None
                self._norms[k] = [torch.linalg.vector_norm(v, 2.0).to(HOST) for v in s.views(s.dev_grad)]
                s.stash_grads()
                if k == 0:  # the last backward: every norm is in (as clip_grad_norm_ computes it)
                    per_param = [n for j in range(len(self.shards)) for n in self._norms[j]]
                    total = torch.linalg.vector_norm(torch.stack(per_param), 2.0)
                    self._coef = torch.clamp(clip / (total + 1e-6), max=1.0)
            else:
                if clip > 0:  # one shard
                    torch.nn.utils.clip_grad_norm_(s.params, clip)
                s.step()
                s.drop_grads()
        place.ledger.release(f"t{self.index}.in")
        place.ledger.release(f"t{self.index}.target")

    @torch.no_grad()
    def evaluate(self, place: Place) -> float:
        """The loop's validation loss (same fixed batches), computed shard by shard at `place`."""
        cfg = self.job.train
        batches = list(val_batches(self.data, recipe=self.recipe, cfg=cfg))
        hs = [x.to(place.device) for x, _ in batches]
        self.model.eval()
        for k, s in enumerate(self.shards):
            self.copy_in(k, place, state=False)
            s.ready()
            hs = [s.forward(h) for h in hs]
            s.spill()
        self.model.train()
        total = sum(
            self.recipe.loss(h, y.to(place.device)).item() for h, (_, y) in zip(hs, batches, strict=True)
        )
        _sync(place)
        return total / cfg.eval_batches

    # -- shared memory (CPU device processes, trainer/selection/devices.py) -----------------------

    def _state_tensors(self) -> list[tuple[torch.Tensor, Callable[[torch.Tensor], None]]]:
        """Every tensor that outlives a mini-batch, in a fixed order, each with how to rebind it:
        per shard its host copy, its optimizer state and step counts; then the model's buffers
        (e.g. running statistics, updated in place by a training forward)."""
        out: list[tuple[torch.Tensor, Callable[[torch.Tensor], None]]] = []
        for s in self.shards:
            assert s.dev is None and s.opt is not None, f"shard {s.index} must be spilled to be shared"

            def host(new: torch.Tensor, s: HostShard = s) -> None:
                s.host = new
                for p, view in zip(s.params, s.views(new), strict=True):
                    p.data = view

            out.append((s.host, host))
            for k, flat in s.state_host.items():

                def state(new: torch.Tensor, s: HostShard = s, k: str = k) -> None:
                    s.state_host[k] = new
                    for p, view in zip(s.params, s.views(new), strict=True):
                        s.opt.state[p][k] = view

                out.append((flat, state))
            if s.params and all("step" in s.opt.state[p] for p in s.params):
                # one tensor of step counts, each parameter's a 0-dim view (AdamW adds to it in place)
                steps = torch.stack([s.opt.state[p]["step"].reshape(()) for p in s.params])

                def step(new: torch.Tensor, s: HostShard = s) -> None:
                    for i, p in enumerate(s.params):
                        s.opt.state[p]["step"] = new[i]

                out.append((steps, step))
        seen: set[int] = set()
        for mod in self.model.modules():
            for name, b in mod._buffers.items():
                if b is None or id(b) in seen:
                    continue
                seen.add(id(b))

                def buffer(new: torch.Tensor, mod: nn.Module = mod, name: str = name) -> None:
                    mod._buffers[name] = new

                out.append((b, buffer))
        return out

    def share(self) -> torch.Tensor:
        """Move every tensor that outlives a mini-batch (weights, optimizer state, step counts,
        buffers) into one block of shared memory, rebinding them there; returns the block. A
        process forked after this, or one that `adopt`s the block, trains the same tensors in
        place: nothing is copied when the trial moves between device processes."""
        return self._bind(None)

    def adopt(self, block: torch.Tensor) -> None:
        """Bind this trial, built from the same job, to `share`'s block from another process."""
        self._bind(block)

    def _bind(self, block: torch.Tensor | None) -> torch.Tensor:
        tensors = self._state_tensors()
        offsets, total = [], 0
        for t, _ in tensors:
            offsets.append(total)
            total += -(-t.numel() * t.element_size() // 64) * 64  # 64-byte aligned: any dtype views
        if block is None:
            new_block = torch.empty(total, dtype=torch.uint8).share_memory_()
        else:
            if block.numel() != total:
                raise ValueError(
                    f"trial {self.index}: shared block of {block.numel()} bytes, this build needs {total}"
                )
            new_block = block
        for (t, rebind), o in zip(tensors, offsets, strict=True):
            view = new_block[o : o + t.numel() * t.element_size()].view(t.dtype).view(t.shape)
            if block is None:
                view.copy_(t)
            rebind(view)
        return new_block

    # -- checkpoints (every shard is spilled between tasks, so the host copies are the truth) ----

    def state(self) -> dict[str, Any]:
        model = {
            n: v.detach().clone()
            for s in self.shards
            for n, v in zip(s.names, s.master_values(), strict=True)
        }
        optim: dict[str, Any] = {}
        for s in self.shards:
            assert s.opt is not None
            for name, p, i in zip(s.names, s.params, range(len(s.params)), strict=True):
                st: dict[str, Any] = {k: s.views(flat)[i].clone() for k, flat in s.state_host.items()}
                if "step" in s.opt.state[p]:
                    st["step"] = float(s.opt.state[p]["step"])
                optim[name] = st
        return {"model": model, "optimizer": {"per_param": optim}}

    def save(self, directory: Path) -> Path:
        return save_checkpoint(directory, step=self.step, state=self.state())

    def _load_model(self, model: dict[str, torch.Tensor]) -> None:
        for s in self.shards:
            for name, view in zip(s.names, s.views(s.host), strict=True):
                view.copy_(model[name])

    def resume(self, directory: Path | None) -> int:
        """Continue from the latest checkpoint in `directory`, if any; returns the step."""
        path = latest_checkpoint(directory)
        if path is None:
            return self.step
        sd = load_checkpoint(path)
        self._load_model(sd["model"])
        per_param = sd["optimizer"]["per_param"]
        for s in self.shards:
            for name, p, i in zip(s.names, s.params, range(len(s.params)), strict=True):
                st = per_param[name]
                for k, flat in s.state_host.items():
                    s.views(flat)[i].copy_(st[k])
                if "step" in s.opt.state[p]:  # in place: the count may live in shared memory
                    s.opt.state[p]["step"].fill_(float(st["step"]))
        self.step = int(sd["step"])
        return self.step

    def warm_start(self, path: Path) -> None:
        """Start from another trial's weights (a checkpoint file or directory); fresh optimizer.
        Reads this package's checkpoints and trainer/loop.py's (both keep "model" by name)."""
        if path.is_dir():
            found = latest_checkpoint(path)
            if found is None:
                raise FileNotFoundError(f"no checkpoint in {path} to warm-start trial {self.index} from")
            path = found
        self._load_model(load_checkpoint(path)["model"])
