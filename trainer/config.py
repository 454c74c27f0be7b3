"""The trainer's view of a job: the JobSpec models of jobrules/spec.py under the trainer's names.

The request is defined once, there (every field, default, bound and allowed value, and the
cross-field rules); the API answers 422 from the same models, so `python -m trainer --spec job.json`
refuses a bad spec without the service, with the API's words. The trainer reads the validated
models as they are (attributes, `model_copy(update=...)` for a changed copy).
"""

from __future__ import annotations

from typing import Any

from jobrules.spec import (
    DataSpec,
    EnvSpec,
    JobSpec,
    ModelSpec,
    OffloadSpec,
    ParallelSpec,
    PipelineSpec,
    ResourceSpec,
    SpecError,
    SpillSpec,
    TensorSpec,
    TrainSpec,
    parse_job,
)

ConfigError = SpecError
"""A spec that can never run (the spec's rules, or what the trainer finds at start: a data file
too short, a layout the model cannot split); the message names the field and the rule."""

ModelConfig = ModelSpec
DataConfig = DataSpec
TrainConfig = TrainSpec
SpillConfig = SpillSpec
OffloadConfig = OffloadSpec
PipelineConfig = PipelineSpec
TensorConfig = TensorSpec
ParallelConfig = ParallelSpec
ResourceConfig = ResourceSpec
EnvConfig = EnvSpec


class JobConfig(JobSpec):
    """A validated JobSpec, as the trainer runs it."""

    @classmethod
    def from_dict(cls, spec: Any, *, workspace: bool = True, pip_options: bool = True) -> JobConfig:
        """Validate a JobSpec document (unknown keys are errors: a typo should not be ignored).
        Library callers set the workspace themselves (trainer/workspace.py), so relative paths are
        taken as the workspace's unless `workspace` is False; pip options were vetted by the worker
        that built the environment."""
        return parse_job(spec, model=cls, workspace=workspace, pip_options=pip_options)
