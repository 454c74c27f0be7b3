"""Chooses the engine a job needs. The order of the checks is the order of precedence: a job that
asks for a pipeline or tensor parallelism runs under those engines (which may compose spilling or
offload inside a stage); a single-rank job with a spill budget runs on the spilling engine."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from trainer.config import ConfigError, JobConfig
from trainer.data import with_data_vocab
from trainer.distributed import env_world_size
from trainer.protocol import MetricsSink, StopSignal
from trainer.user_model import check_user_model


def run(
    job: JobConfig,
    *,
    sink: MetricsSink,
    stop: StopSignal,
    checkpoint_dir: Path | None = None,
) -> dict[str, Any]:
    job = with_data_vocab(job)  # built-in models take the data's vocabulary
    if job.model.kind == "python":
        check_user_model(job)
    par = job.parallel
    world = env_world_size()
    if par.world_size != world:
        raise ConfigError(
            f"the job needs {par.world_size} processes (pipeline stages x tensor ranks x "
            f"data_parallel) but WORLD_SIZE is {world}; launch it with torchrun "
            f"--nproc-per-node {par.world_size}"
        )
    if par.pipeline is not None and par.pipeline.stages > 1:
        from trainer.pipeline.job import train_pipeline

        return train_pipeline(job, sink=sink, stop=stop, checkpoint_dir=checkpoint_dir)
    if par.tensor is not None and par.tensor.world_size > 1:
        from trainer.tensor.job import train_tensor

        return train_tensor(job, sink=sink, stop=stop, checkpoint_dir=checkpoint_dir)
    if par.spill is not None or (par.offload is not None and par.offload.optimizer):
        from trainer.spill.job import train_spilled

        return train_spilled(job, sink=sink, stop=stop, checkpoint_dir=checkpoint_dir)
    if par.data_parallel > 1:
        raise ConfigError("parallel.data_parallel > 1 without a pipeline or tensor axis is not supported yet")
    from trainer.loop import train

    return train(job, sink=sink, stop=stop, checkpoint_dir=checkpoint_dir)
