"""One ordered function applies the parallelisms of a job to a model recipe, on this rank only.

    parallelize(recipe, job, mesh, device) -> Parallelized

Order, and why it is this one:
  1. pipeline split  - decides which layers this rank holds at all; everything after works only on
                       those, so no rank ever materialises a layer it does not keep (the split is
                       computed on the meta skeleton: shapes and parameter counts, no memory);
  2. tensor parallel - per stage, replaces each held layer by its shard; each layer is made real
                       alone (seeded by (seed, layer index), trainer/recipe.py) and sliced at once,
                       so a rank's peak is its shards plus ONE dense layer, never a dense stage;
  3. offload         - per stage, flattens the final (sharded) parameters into one low-precision
                       device buffer and moves fp32 masters and optimizer state to host memory;
                       before tensor parallelism it would offload dense tensors about to be replaced;
                       spilling (HYDRA) runs its own forward/backward and is refused beside any
                       parallel axis by jobrules/parallel.py;
  4. data parallel   - last: it only averages the gradients of whatever parameters steps 1-3 left
                       on this rank, over the replicas that hold the same pieces (the dp group).

Model code never branches on what is enabled: recipes build dense layers; this function and the
engine (trainer/engine.py) are the only places that know the layout.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from jobrules.spec import JobSpec, SpecError
from trainer.mesh import WorldMesh
from trainer.optim import OffloadedOptimizer, TorchOptimizer
from trainer.recipe import ModelRecipe, layer_param_counts, materialize_layer, meta_layers


class Stage(nn.Module):
    """Contiguous layers of the model, registered under their GLOBAL indices: a stage's parameter
    names are the whole model's (`3.attn.qkv.weight`), so checkpoints and tests match any piece to
    the dense model. A one-stage Stage has exactly nn.Sequential's state_dict keys."""

    def __init__(self, layers: dict[int, nn.Module]) -> None:
        super().__init__()
        self.indices = sorted(layers)
        for i in self.indices:
            self.add_module(str(i), layers[i])

    def forward(self, x: Any) -> Any:
        for i in self.indices:
            x = getattr(self, str(i))(x)
        return x


@dataclass(kw_only=True, slots=True)
class Parallelized:
    """What this rank holds and steps."""

    modules: dict[tuple[int, int], Stage]
    """(stage, replica) -> module on the device; one entry (0, 0) without a pipeline, two per rank
    for Chimera (its down and up pipelines hold different stages here)."""
    bounds: list[tuple[int, int]]
    """Layer index range [lo, hi) of each pipeline stage."""
    optimizer: TorchOptimizer | OffloadedOptimizer
    n_params: int
    """The whole model's parameter count (from the meta skeleton)."""
    schedule: Any = None
    """trainer.pipeline.schedules.Schedule when pp > 1."""
    param_dtype: torch.dtype = torch.float32

    def named_parameters(self) -> list[tuple[str, nn.Parameter]]:
        return [(n, p) for m in self.modules.values() for n, p in m.named_parameters()]

    def norm_parameters(self) -> list[nn.Parameter]:
        """One copy of each distinct piece on this rank (Chimera's stage copies carry equal
        gradients after their exchange; count the replica-0 copy only)."""
        return [p for (_, rep), m in self.modules.items() if rep == 0 for p in m.parameters()]


def stage_bounds(recipe: ModelRecipe, stages: int) -> list[tuple[int, int]]:
    """Contiguous layer ranges balanced by parameter count (on the meta skeleton)."""
    from trainer.pipeline.stage import partition

    if stages == 1:
        return [(0, recipe.n_layers)]
    return partition(layer_param_counts(recipe), stages)


def _tp_layer(recipe: ModelRecipe, index: int, layer: nn.Module, mesh: WorldMesh) -> nn.Module:
    from trainer.tensor.block import shard_layer

    hint = recipe.tp_hint(index)
    if hint is None:
        raise SpecError(
            f"model.kind {recipe.kind!r}: layer {index} has no tensor-parallel form (tp_hint None)"
        )
    return shard_layer(layer, grid=mesh.tp_grid, name=str(index))


def parallelize(recipe: ModelRecipe, job: JobSpec, *, mesh: WorldMesh, device: torch.device) -> Parallelized:
    cfg, par = job.train, job.parallel
    shape = mesh.shape
    n_params = sum(layer_param_counts(recipe))

    # 1. pipeline split: which (stage, replica) pieces live on this rank
    schedule = None
    held: list[tuple[int, int]] = [(0, 0)]
    if shape.pp > 1:
        from trainer.pipeline.checker import check_schedule
        from trainer.pipeline.schedules import build_schedule

        assert par.pipeline is not None
        schedule = build_schedule(
            par.pipeline.schedule, stages=shape.pp, microbatches=par.pipeline.microbatches
        )
        check_schedule(schedule)
        held = schedule.stages_on(mesh.pp_index)
    bounds = stage_bounds(recipe, shape.pp)

    modules: dict[tuple[int, int], Stage] = {}
    for stage, replica in held:
        lo, hi = bounds[stage]
        layers: dict[int, nn.Module] = {}
        for i in range(lo, hi):
            # materialised alone from (seed, i): Chimera's second copy gets the same weights
            layer = materialize_layer(recipe, i, seed=cfg.seed)
            # 2. tensor parallel: slice at once, drop the dense layer
            if shape.tp > 1:
                layer = _tp_layer(recipe, i, layer, mesh)
            layers[i] = layer.to(device)
        modules[(stage, replica)] = Stage(layers)

    # 3. offload (spill is refused beside parallel axes by jobrules) or device-resident state
    named = [(n, p) for m in modules.values() for n, p in m.named_parameters()]
    off = par.offload
    optimizer: TorchOptimizer | OffloadedOptimizer
    if off is not None and off.optimizer:
        optimizer = OffloadedOptimizer(named, cfg=cfg, offload=off, device=device)
        param_dtype = optimizer.dtype
    else:
        optimizer = TorchOptimizer(named, cfg=cfg)
        param_dtype = torch.float32

    # 4. data parallel: nothing to wrap; the engine averages these parameters' gradients over
    # mesh.dp_group once per step (trainer/grads.py)
    return Parallelized(
        modules=modules,
        bounds=bounds,
        optimizer=optimizer,
        n_params=n_params,
        schedule=schedule,
        param_dtype=param_dtype,
    )


def boundary_shape(recipe: ModelRecipe, *, upto: int, inputs: torch.Tensor) -> tuple[int, ...]:
    """Shape of the activation leaving layer `upto - 1` for `inputs` (run on the meta skeleton)."""
    x: Any = torch.empty(inputs.shape, dtype=inputs.dtype, device="meta")
    with torch.no_grad():
        for layer in meta_layers(recipe)[:upto]:
            x = layer(x)
    return tuple(x.shape)
