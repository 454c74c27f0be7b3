"""The composed engine: steps whatever trainer/parallelize.py left on this rank (a whole model, a
pipeline stage or two, tensor shards, offloaded or device-resident optimizer state) as one
data-parallel replica among `dp`. It plugs into trainer/loop.py's `run_steps` like every engine.

One training step on a rank:
  rows      the global batch -> this replica's rows (dp) -> a tensor grid's row block (2d/2.5d)
  forward/backward
            no pipeline: model(x), the loss, backward; a pipeline: the driver runs the schedule
            (micro-batch losses divided by N, so the gradients sum to the replica's mean)
  reduce    gradients averaged over the dp group (bucketed, once per step)
  clip      global norm summed over this replica's ranks (pp x tp), never over WORLD
  step      the optimizer (torch or offloaded AdamW)
  report    every rank adds its share of the loss (last stage only; a tensor row block's value
            divided by the ranks holding it; a replica's by dp) and one all-reduce gives every
            rank the global mean loss.
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist

from jobrules.spec import JobSpec, SpecError
from trainer.grads import average_gradients, clip_coefficient, grad_norm, replica_rows
from trainer.mesh import WorldMesh
from trainer.parallelize import Parallelized, boundary_shape
from trainer.protocol import MetricsSink
from trainer.recipe import ModelRecipe


class ComposedEngine:
    def __init__(
        self,
        *,
        recipe: ModelRecipe,
        job: JobSpec,
        mesh: WorldMesh,
        parts: Parallelized,
        device: torch.device,
    ) -> None:
        self.recipe, self.job, self.mesh, self.parts, self.device = recipe, job, mesh, parts, device
        shape = mesh.shape
        self.n_params = parts.n_params
        self.tp_grid: Any = mesh.tp_grid
        self.tesseract = self.tp_grid is not None and self.tp_grid.mode != "1d"
        self.rows = job.train.batch_size // shape.dp  # a replica's rows
        self.micro = job.parallel.pipeline.microbatches if shape.pp > 1 and job.parallel.pipeline else 1
        # the ranks holding one (row block of a) replica's loss value: all tp ranks in 1d, a row's
        # q column peers on the grid
        held_by = 1 if self.tp_grid is None else (self.tp_grid.q if self.tesseract else self.tp_grid.size)
        self.loss_weight = 1.0 / (held_by * shape.dp)
        self.params = [p for _, p in parts.named_parameters()]
        if self.tp_grid is not None:
            from trainer.tensor import comm

            # count this run's tensor-parallel traffic (evaluation excluded, see eval_loss)
            comm.LEDGER.reset()
            comm.LEDGER.enabled = True
        self.driver: Any = None
        self.last_record: Any = None
        self.checkpoint_subdir = None if shape.pp * shape.tp == 1 else f"pp{mesh.pp_index}-tp{mesh.tp_index}"
        self.writes_checkpoints = mesh.dp_index == 0

    # ---- rows and loss ------------------------------------------------------------------------
    def _local(self, t: torch.Tensor) -> torch.Tensor:
        t = replica_rows(t, index=self.mesh.dp_index, replicas=self.mesh.shape.dp)
        if self.tp_grid is not None:
            from trainer.tensor.block import local_batch

            t = local_batch(t, grid=self.tp_grid)
        return t

    def _loss_fn(self, rows: int) -> Any:
        """The loss of `rows` replica rows (a micro-batch or a replica's batch): the recipe's mean,
        or under tensor parallelism this rank's part of it (the tensor-parallel cross entropy)."""
        if self.tp_grid is None:
            return self.recipe.loss
        from trainer.tensor.block import loss_fn

        grid = self.tp_grid
        return lambda out, y: loss_fn(out, y, grid=grid, global_rows=rows)

    def _global(self, local: torch.Tensor | float) -> float:
        t = (
            torch.as_tensor(local, dtype=torch.float64, device=self.device).detach().reshape(1)
            * self.loss_weight
        )
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(t)
        return float(t.item())  # note: a CPU-GPU sync point, once per step

    def _act_shape(self, x_local: torch.Tensor, stage: int) -> tuple[int, ...]:
        s = boundary_shape(self.recipe, upto=self.parts.bounds[stage][1], inputs=x_local)
        if self.tesseract:
            # a grid rank holds its row block (already in x_local) and 1/q of the features
            s = (*s[:-1], s[-1] // self.tp_grid.q)
        return s

    def _build_driver(self, x_local: torch.Tensor) -> None:
        """Built at the first step, from the real batch's shapes (a recipe's inputs may be anything
        with rows first)."""
        from trainer.pipeline.driver import PipelineDriver

        x_mb = x_local.chunk(self.micro)[0]
        shapes = {self._act_shape(x_mb, s) for s in range(self.mesh.shape.pp - 1)}
        if len(shapes) != 1:
            raise SpecError(
                f"model.kind {self.recipe.kind!r}: the activations between pipeline stages differ in shape "
                f"({sorted(shapes)}); the pipeline driver passes one shape"
            )
        self.driver = PipelineDriver(
            sched=self.parts.schedule,
            rank=self.mesh.pp_index,
            modules=self.parts.modules,
            act_shape=shapes.pop(),
            act_dtype=self.parts.param_dtype,
            device=self.device,
            ranks=self.mesh.pipeline_ranks,
            loss_fn=self._loss_fn(self.rows // self.micro),
        )

    # ---- the engine interface -----------------------------------------------------------------
    def train_step(self, inputs: torch.Tensor, targets: torch.Tensor) -> float:
        x, y = self._local(inputs), self._local(targets)
        opt = self.parts.optimizer
        opt.zero_grad()
        if self.mesh.shape.pp > 1:
            if self.driver is None:
                self._build_driver(x)
            rec = self.driver.step(x, y, t0=time.perf_counter())
            self.last_record = rec
            local: torch.Tensor | float = rec.loss
        else:
            (model,) = self.parts.modules.values()
            loss = self._loss_fn(self.rows)(model(x.to(self.device)), y.to(self.device))
            loss.backward()
            local = loss.detach()
        average_gradients(self.params, group=self.mesh.dp_group)
        coef = None
        if self.job.train.grad_clip > 0:
            norm = grad_norm(
                self.parts.norm_parameters(), groups=(self.mesh.replica_group,), device=self.device
            )
            coef = clip_coefficient(norm, max_norm=self.job.train.grad_clip)
        opt.step(clip_coef=coef)
        return self._global(local)

    @torch.no_grad()
    def eval_loss(self, inputs: torch.Tensor, targets: torch.Tensor) -> float:
        x, y = self._local(inputs), self._local(targets)
        for m in self.parts.modules.values():
            m.eval()
        try:
            if self.tp_grid is not None:
                from trainer.tensor import comm

                with comm.paused():
                    local = self._eval_local(x, y)
            else:
                local = self._eval_local(x, y)
        finally:
            for m in self.parts.modules.values():
                m.train()
        return self._global(local)

    def _eval_local(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = self._loss_fn(self.rows)
        if self.mesh.shape.pp == 1:
            (model,) = self.parts.modules.values()
            return loss(model(x.to(self.device)), y.to(self.device))
        # the replica-0 stages, one blocking send/recv per boundary, in stage order: the same order
        # on both sides of every pair, no tags (NCCL-safe)
        stage, pp = self.mesh.pp_index, self.mesh.shape.pp
        ranks = self.mesh.pipeline_ranks
        mod = self.parts.modules[(stage, 0)]
        if stage == 0:
            h = mod(x.to(self.device))
        else:
            h = torch.empty(self._act_shape(x, stage - 1), dtype=self.parts.param_dtype, device=self.device)
            dist.recv(h, src=ranks[stage - 1])
            h = mod(h)
        if stage < pp - 1:
            dist.send(h.contiguous(), dst=ranks[stage + 1])
            return torch.zeros((), device=self.device)
        return loss(h, y.to(self.device))

    def step_metrics(self) -> dict[str, float]:
        return {}

    def eval_report(self, step: int, sink: MetricsSink) -> None:
        """At each evaluation: the pipeline's executed and simulated timelines (one pipeline's)."""
        if self.driver is None or self.last_record is None:
            return
        from trainer.pipeline.timeline import timeline_event

        rec = self.last_record
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(
            gathered,
            {
                "timeline": rec.timeline,
                "peak_stash": rec.peak_stash,
                "first": self.mesh.dp_index + self.mesh.tp_index == 0,
            },
        )
        mine = [g for g in gathered if g["first"]]
        event = timeline_event([g["timeline"] for g in mine], sched=self.parts.schedule)
        event["step"] = step
        event["peak_stash_executed"] = [g["peak_stash"] for g in mine]
        self._bubble = event["bubble_executed"]
        sink.event("timeline", event)

    def state_dict(self) -> dict[str, Any]:
        model = {n: t for m in self.parts.modules.values() for n, t in m.state_dict().items()}
        opt = self.parts.optimizer
        if opt.offloaded:
            model.update(opt.model_state())
        return {"model": model, "optimizer": opt.state_dict()}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        for m in self.parts.modules.values():
            mine = m.state_dict().keys()
            m.load_state_dict({k: sd["model"][k] for k in mine})
        opt = self.parts.optimizer
        if opt.offloaded:
            opt.load_model_state(sd["model"])
        opt.load_state_dict(sd["optimizer"])

    def describe(self) -> str:
        s = self.mesh.shape
        parts = [f"pp={s.pp} dp={s.dp} tp={s.tp}"]
        if s.pp > 1 and self.job.parallel.pipeline:
            p = self.job.parallel.pipeline
            parts.append(f"pipeline {p.schedule} N={p.microbatches}")
        if s.tensor is not None:
            parts.append(f"tensor {s.tensor.mode}")
        if self.parts.optimizer.offloaded:
            parts.append(f"offloaded AdamW ({self.job.parallel.offload.dtype})")  # type: ignore[union-attr]
        local = sum(p.numel() for p in self.params)
        return ", ".join(parts) + f"; {local:,} parameters on rank 0"

    def start_info(self) -> dict[str, Any]:
        s = self.mesh.shape
        return {
            "mesh": {"pp": s.pp, "dp": s.dp, "tp": s.tp},
            "params_rank0": sum(p.numel() for p in self.params),
        }

    def summary(self, *, steps_ran: int, sink: MetricsSink) -> dict[str, Any]:
        """Extra result keys (every rank calls it: it may gather)."""
        s = self.mesh.shape
        out: dict[str, Any] = {"mesh": {"pp": s.pp, "dp": s.dp, "tp": s.tp}, "data_parallel": s.dp}
        out["params_rank0"] = sum(p.numel() for p in self.params)
        if self.driver is not None and self.job.parallel.pipeline:
            p = self.job.parallel.pipeline
            out["pipeline"] = {
                "schedule": p.schedule,
                "stages": s.pp,
                "microbatches": p.microbatches,
                "bubble_executed": getattr(self, "_bubble", float("nan")),
            }
        if self.tp_grid is not None:
            from trainer.tensor.traffic import tensor_summary

            tensor = tensor_summary(grid=self.tp_grid, tensor=s.tensor, steps=steps_ran)
            sink.event("comm", tensor.pop("comm"))
            out.update(tensor)
        return out

    def close(self) -> None:
        if self.driver is not None:
            self.driver.close()
        if dist.is_initialized() and dist.get_world_size() > 1:
            # leave together: a rank that tears its process group down while a peer still talks
            # to it makes gloo abort that peer
            dist.barrier()
