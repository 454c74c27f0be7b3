"""Runs a job: checks the layout, builds the engine, hands it to the one step loop.

Every spec JobSpec accepts runs as asked (jobrules/parallel.py refuses the rest, for the API and
`python -m trainer` alike). Two engines:
  - the spilling engine (trainer/spill/job.py) for `parallel.spill`, and for
    `parallel.offload.optimizer` on a single process (it runs fp16 loss scaling too);
  - the composed engine (trainer/engine.py) for everything else: plain, pipeline, tensor, data
    parallel and offloaded optimizer, in any combination, applied by trainer/parallelize.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from jobrules.spec import JobSpec
from trainer.data import data_for, with_data_vocab
from trainer.device import pick_device
from trainer.distributed import env_world_size, init_from_env
from trainer.loop import Engine, run_steps
from trainer.mesh import MeshShape, build_world_mesh, single_process_mesh
from trainer.models import recipe_for
from trainer.protocol import MetricsSink, NullSink, StopSignal
from trainer.recipe import ModelRecipe
from trainer.user_model import check_user_model


def run(
    job: JobSpec,
    *,
    sink: MetricsSink,
    stop: StopSignal,
    checkpoint_dir: Path | None = None,
    device: torch.device | None = None,
) -> dict[str, Any]:
    job = with_data_vocab(job)  # built-in models take the data's vocabulary
    if job.model.kind == "python":
        check_user_model(job, recipe=recipe_for(job.model))
    engine, recipe, sink = build_engine(job, sink=sink, device=device)
    data = data_for(job)
    return run_steps(
        engine, job=job, recipe=recipe, data=data, sink=sink, stop=stop, checkpoint_dir=checkpoint_dir
    )


def build_engine(
    job: JobSpec, *, sink: MetricsSink, device: torch.device | None = None
) -> tuple[Engine, ModelRecipe, MetricsSink]:
    """The engine for `job` on this rank, its recipe, and the sink this rank reports to (silent
    on every rank but 0). Joins the process group torchrun described when the job has several."""
    shape = MeshShape.from_job(job)
    # before any process group: a wrong launch fails in milliseconds with the numbers
    shape.check(torch.distributed.get_world_size() if _initialized() else env_world_size())
    recipe = recipe_for(job.model)
    par = job.parallel
    if par.spill is not None or (par.offload is not None and par.offload.optimizer and shape.world_size == 1):
        from trainer.spill.job import SpilledEngine

        device = device or pick_device(job.resources.device)
        return SpilledEngine(job, recipe=recipe, sink=sink, device=device), recipe, sink

    from trainer.engine import ComposedEngine
    from trainer.parallelize import parallelize

    if shape.world_size == 1:
        mesh = single_process_mesh()
        device = device or pick_device(job.resources.device)
    else:
        device, mesh = _join(job, shape)
        if not mesh.lead:
            sink = NullSink()
    parts = parallelize(recipe, job, mesh=mesh, device=device)
    return ComposedEngine(recipe=recipe, job=job, mesh=mesh, parts=parts, device=device), recipe, sink


def _initialized() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def _join(job: JobSpec, shape: MeshShape) -> tuple[torch.device, Any]:
    want = job.resources.device
    cuda = want == "cuda" or (want == "auto" and torch.cuda.is_available())
    device_type = "cuda" if cuda else "cpu"
    # join first: on GPUs init_from_env selects this rank's device (LOCAL_RANK), which pick_device reads
    init_from_env(device_type=device_type)
    device = pick_device(want) if cuda else torch.device("cpu")
    return device, build_world_mesh(shape, device_type=device_type)
