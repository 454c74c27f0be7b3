"""Request and response models. JobSpec mirrors trainer/config.py's JobConfig (the trainer checks
again on its side); every rule's message names the field and the numbers."""

from __future__ import annotations

from datetime import datetime
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from api import sizing


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ModelSpec(Strict):
    kind: Literal["gpt", "mlp"] = "gpt"
    layers: int = Field(4, ge=1, le=256)
    d_model: int = Field(128, ge=8, le=16384)
    heads: int = Field(4, ge=1, le=256)
    seq_len: int = Field(64, ge=1, le=8192)
    vocab_size: Literal[128] = 128
    mlp_ratio: int = Field(4, ge=1, le=16)

    @model_validator(mode="after")
    def _heads_divide(self) -> ModelSpec:
        if self.d_model % self.heads:
            raise ValueError(
                f"model.d_model ({self.d_model}) must be divisible by model.heads ({self.heads})"
            )
        return self


class DataSpec(Strict):
    kind: Literal["text"] = "text"
    corpus: Literal["stdlib"] = "stdlib"
    max_chars: int = Field(4_000_000, ge=10_000, le=200_000_000)
    val_fraction: float = Field(0.1, gt=0.0, lt=0.5)


class TrainSpec(Strict):
    steps: int = Field(200, ge=1, le=10_000_000)
    batch_size: int = Field(16, ge=1, le=65536)
    lr: float = Field(3e-4, gt=0.0, le=10.0)
    optimizer: Literal["adamw", "sgd"] = "adamw"
    weight_decay: float = Field(0.0, ge=0.0, le=1.0)
    momentum: float = Field(0.0, ge=0.0, lt=1.0)
    seed: int = Field(0, ge=0, le=2**31 - 1)
    eval_every: int = Field(25, ge=1)
    eval_batches: int = Field(4, ge=1, le=1000)
    grad_clip: float = Field(0.0, ge=0.0)


class SpillSpec(Strict):
    device_budget_mb: float = Field(gt=0)
    prefetch: bool = True
    cuts: list[int] | None = None


class OffloadSpec(Strict):
    optimizer: bool = False
    dtype: Literal["bf16", "fp16", "fp32"] = "bf16"


class PipelineSpec(Strict):
    stages: int = Field(2, ge=1, le=64)
    microbatches: int = Field(4, ge=1, le=4096)
    schedule: Literal["gpipe", "1f1b", "chimera", "chimera-zb", "async"] = "1f1b"

    @model_validator(mode="after")
    def _chimera_even(self) -> PipelineSpec:
        if self.schedule.startswith("chimera") and self.stages % 2:
            raise ValueError(
                f"parallel.pipeline.stages must be even for {self.schedule} "
                f"(two pipelines in opposite directions), got {self.stages}"
            )
        return self


class TensorSpec(Strict):
    mode: Literal["1d", "2d", "2.5d"] = "1d"
    size: int = Field(1, ge=1, le=512)
    q: int = Field(1, ge=1, le=64)
    d: int = Field(1, ge=1, le=64)

    @property
    def world_size(self) -> int:
        return {"1d": self.size, "2d": self.q * self.q, "2.5d": self.q * self.q * self.d}[self.mode]


class ParallelSpec(Strict):
    spill: SpillSpec | None = None
    offload: OffloadSpec | None = None
    pipeline: PipelineSpec | None = None
    tensor: TensorSpec | None = None
    data_parallel: int = Field(1, ge=1, le=1024)

    @property
    def world_size(self) -> int:
        stages = self.pipeline.stages if self.pipeline else 1
        tp = self.tensor.world_size if self.tensor else 1
        return stages * tp * self.data_parallel


class ResourceSpec(Strict):
    device: Literal["auto", "cpu", "cuda"] = "auto"
    gpus: int = Field(0, ge=0, le=1024)


class JobSpec(Strict):
    """A training job. See README.md for every field."""

    name: str = Field("job", min_length=1, max_length=200)
    model: ModelSpec = Field(default_factory=ModelSpec)
    data: DataSpec = Field(default_factory=DataSpec)
    train: TrainSpec = Field(default_factory=TrainSpec)
    parallel: ParallelSpec = Field(default_factory=ParallelSpec)
    resources: ResourceSpec = Field(default_factory=ResourceSpec)
    checkpoint_every: int = Field(0, ge=0)
    priority: int = Field(0, ge=-100, le=100)

    @model_validator(mode="after")
    def _cross_field(self) -> JobSpec:
        problems = sizing.spec_problems(self.model_dump())
        if problems:
            raise ValueError("; ".join(problems))
        return self

    @property
    def queue(self) -> str:
        return "gpu" if self.resources.gpus > 0 or self.resources.device == "cuda" else "cpu"


class Progress(BaseModel):
    step: int
    steps: int
    loss: float | None = None


class JobPublic(BaseModel):
    id: int
    name: str
    kind: str
    status: str
    priority: int
    queue: str
    world_size: int
    attempts: int
    created_at: datetime
    started_at: datetime | None
    finished_at: datetime | None
    worker: str | None
    error: str | None
    result: dict[str, Any] | None
    spec: dict[str, Any]
    cancel_requested: bool
    progress: Progress
    selection_id: int | None


class JobsPublic(BaseModel):
    items: list[JobPublic]
    total: int


class Series(BaseModel):
    steps: list[int]
    values: list[float]


class MetricsPublic(BaseModel):
    job_id: int
    series: dict[str, Series]


class EventPublic(BaseModel):
    id: int
    time: float
    kind: str
    message: str
    data: dict[str, Any] | None


class EventsPublic(BaseModel):
    items: list[EventPublic]


class WorkerPublic(BaseModel):
    name: str
    hostname: str
    queues: list[str]
    devices: list[dict[str, Any]]
    last_seen: datetime


class HealthPublic(BaseModel):
    status: Literal["ok", "degraded"]
    db: dict[str, Any]
    broker: dict[str, Any]
    workers: list[WorkerPublic]


# ---- selections -------------------------------------------------------------------------------


class EarlyStoppingSpec(Strict):
    kind: Literal["asha"] = "asha"
    reduction_factor: int = Field(3, ge=2, le=16)
    min_steps: int = Field(1, ge=1)


class SelectionCreate(Strict):
    """A model-selection batch: trials of `base` over `space`."""

    name: str = Field("selection", min_length=1, max_length=200)
    base: JobSpec
    space: dict[str, Any] = Field(
        min_length=1, description="dotted JobSpec path -> list or {low, high, log, int, num}"
    )
    method: Literal["grid", "random"] = "random"
    trials: int | None = Field(None, ge=1, le=1024, description="how many (random only)")
    seed: int = Field(0, ge=0)
    metric: str = Field("val_loss", pattern="^(val_loss|loss)$")
    mode: Literal["min", "max"] = "min"
    scheduler: Literal["shard-lrtf", "fifo", "round-robin", "sequential"] = "shard-lrtf"
    devices: int = Field(2, ge=1, le=64, description="devices of one worker the batch alternates over")
    group_size: int = Field(16, ge=1, le=1024, description="trials per worker group; more are split")
    early_stopping: EarlyStoppingSpec | None = None


class TrialsAdd(Strict):
    """Trials to add to a batch: explicit params, or more samples of the batch's own space."""

    params: list[dict[str, Any]] | None = Field(None, min_length=1, max_length=1024)
    trials: int | None = Field(None, ge=1, le=1024, description="more random samples of the batch's space")
    warm_start_from: int | None = Field(
        None, description="trial id whose latest checkpoint seeds the new trials"
    )

    @model_validator(mode="after")
    def _one_source(self) -> TrialsAdd:
        if (self.params is None) == (self.trials is None):
            raise ValueError("give exactly one of params (a list of {path: value}) or trials (a count)")
        return self


class TrialPublic(BaseModel):
    id: int
    index: int
    params: dict[str, Any]
    status: str
    steps_done: int
    steps_total: int
    last_metric: float | None
    best_metric: float | None
    stopped_early: bool
    job_id: int
    warm_start_from: int | None
    result: dict[str, Any] | None = None
    """The executor's report for the trial (steps, best metric, compute/copy seconds, ...)."""
    compute_s: float | None = None
    copy_s: float | None = None
    stop_reason: Any = None
    """Why the trial stopped, as the executor reports it (None while it runs or if it did not say)."""


class SelectionPublic(BaseModel):
    id: int
    name: str
    status: str
    metric: str
    mode: str
    scheduler: str
    created_at: datetime
    started_at: datetime | None
    finished_at: datetime | None
    space: dict[str, Any]
    request: dict[str, Any]
    cancel_requested: bool
    trials: list[TrialPublic]
    leaderboard: list[int]
    """Trial ids with a metric, best first."""


class SelectionsPublic(BaseModel):
    items: list[SelectionPublic]
    total: int
