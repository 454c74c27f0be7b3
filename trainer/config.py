"""Typed configuration of one training job, parsed from the JobSpec JSON.

The REST layer validates the same shape with pydantic (api/schemas.py); these dataclasses are the
trainer's own checks, so `python -m trainer --spec job.json` refuses a bad spec without the service.
Every message carries the numbers that broke the rule.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal

from jobrules.parallel import (
    SCHEDULES,
    TENSOR_MODES,
    axis_sizes,
    parallel_problems,
    tensor_world_size,
    world_size,
)

ModelKind = Literal["gpt", "mlp"]
Optimizer = Literal["adamw", "sgd"]
PipelineSchedule = Literal["gpipe", "1f1b", "chimera", "chimera-zb", "async"]
TensorMode = Literal["1d", "2d", "2.5d"]


class ConfigError(ValueError):
    """A spec that can never run; the message names the field and the rule."""


def _require(ok: bool, msg: str) -> None:
    if not ok:
        raise ConfigError(msg)


@dataclass(kw_only=True, slots=True)
class ModelConfig:
    kind: ModelKind = "gpt"
    """Registry name: `gpt` (decoder-only transformer) or `mlp` (position-wise MLP on characters)."""
    layers: int = 4
    """Number of transformer blocks (gpt) or hidden layers (mlp)."""
    d_model: int = 128
    """Hidden size."""
    heads: int = 4
    """Attention heads (gpt only); must divide d_model."""
    seq_len: int = 64
    """Context length in characters."""
    vocab_size: int = 128
    """Characters are ASCII code points; anything else maps to '?'."""
    mlp_ratio: int = 4
    """Width of the feed-forward layer as a multiple of d_model."""

    def __post_init__(self) -> None:
        _require(self.kind in ("gpt", "mlp"), f"model.kind must be gpt or mlp, got {self.kind!r}")
        _require(1 <= self.layers <= 256, f"model.layers must be in [1, 256], got {self.layers}")
        _require(8 <= self.d_model <= 16384, f"model.d_model must be in [8, 16384], got {self.d_model}")
        _require(1 <= self.heads <= 256, f"model.heads must be in [1, 256], got {self.heads}")
        _require(
            self.d_model % self.heads == 0,
            f"model.d_model ({self.d_model}) must be divisible by model.heads ({self.heads})",
        )
        _require(1 <= self.seq_len <= 8192, f"model.seq_len must be in [1, 8192], got {self.seq_len}")
        _require(self.vocab_size == 128, f"model.vocab_size must be 128 (ASCII), got {self.vocab_size}")
        _require(1 <= self.mlp_ratio <= 16, f"model.mlp_ratio must be in [1, 16], got {self.mlp_ratio}")


@dataclass(kw_only=True, slots=True)
class DataConfig:
    kind: Literal["text"] = "text"
    """Only character-level text for now."""
    corpus: Literal["stdlib"] = "stdlib"
    """`stdlib`: the Python standard library's own source files, present on every machine."""
    max_chars: int = 4_000_000
    """Cap on the characters read (keeps start-up fast)."""
    val_fraction: float = 0.1
    """Held-out tail of the corpus used for validation loss."""

    def __post_init__(self) -> None:
        _require(self.kind == "text", f"data.kind must be 'text', got {self.kind!r}")
        _require(self.corpus == "stdlib", f"data.corpus must be 'stdlib', got {self.corpus!r}")
        _require(self.max_chars >= 10_000, f"data.max_chars must be >= 10000, got {self.max_chars}")
        _require(
            0.0 < self.val_fraction < 0.5,
            f"data.val_fraction must be in (0, 0.5), got {self.val_fraction}",
        )


@dataclass(kw_only=True, slots=True)
class TrainConfig:
    steps: int = 200
    """Optimizer steps."""
    batch_size: int = 16
    """Sequences per step (the global batch)."""
    lr: float = 3e-4
    optimizer: Optimizer = "adamw"
    weight_decay: float = 0.0
    momentum: float = 0.0
    """SGD momentum."""
    seed: int = 0
    eval_every: int = 25
    """Validation loss every this many steps (and at the last step)."""
    eval_batches: int = 4
    grad_clip: float = 0.0
    """Clip the global gradient norm to this value; 0 disables."""

    def __post_init__(self) -> None:
        _require(1 <= self.steps <= 10_000_000, f"train.steps must be in [1, 1e7], got {self.steps}")
        _require(
            1 <= self.batch_size <= 65536,
            f"train.batch_size must be in [1, 65536], got {self.batch_size}",
        )
        _require(0.0 < self.lr <= 10.0, f"train.lr must be in (0, 10], got {self.lr}")
        _require(
            self.optimizer in ("adamw", "sgd"),
            f"train.optimizer must be adamw or sgd, got {self.optimizer!r}",
        )
        _require(self.eval_every >= 1, f"train.eval_every must be >= 1, got {self.eval_every}")
        _require(self.eval_batches >= 1, f"train.eval_batches must be >= 1, got {self.eval_batches}")
        _require(self.grad_clip >= 0, f"train.grad_clip must be >= 0, got {self.grad_clip}")


@dataclass(kw_only=True, slots=True)
class SpillConfig:
    device_budget_mb: float
    """Bytes the spilling engine may hold on the device, in MiB."""
    prefetch: bool = True
    """Copy the next shard in on a side stream while the current one computes."""
    cuts: list[int] | None = None
    """Optional hand-given shard boundaries (indices into the model's layer list)."""

    def __post_init__(self) -> None:
        _require(
            self.device_budget_mb > 0,
            f"parallel.spill.device_budget_mb must be > 0, got {self.device_budget_mb}",
        )


@dataclass(kw_only=True, slots=True)
class OffloadConfig:
    optimizer: bool = False
    """fp32 master weights and Adam moments in pinned host memory."""
    dtype: Literal["bf16", "fp16", "fp32"] = "bf16"
    """Device-side parameter and gradient dtype."""


@dataclass(kw_only=True, slots=True)
class PipelineConfig:
    stages: int = 1
    microbatches: int = 1
    schedule: PipelineSchedule = "1f1b"

    def __post_init__(self) -> None:
        _require(self.stages >= 1, f"parallel.pipeline.stages must be >= 1, got {self.stages}")
        _require(
            self.microbatches >= 1,
            f"parallel.pipeline.microbatches must be >= 1, got {self.microbatches}",
        )
        _require(
            self.schedule in SCHEDULES,
            f"parallel.pipeline.schedule must be one of {', '.join(SCHEDULES)}, got {self.schedule!r}",
        )


@dataclass(kw_only=True, slots=True)
class TensorConfig:
    mode: TensorMode = "1d"
    size: int = 1
    """Ranks for 1d."""
    q: int = 1
    """Grid side for 2d and 2.5d."""
    d: int = 1
    """Depth for 2.5d."""

    def __post_init__(self) -> None:
        _require(
            self.mode in TENSOR_MODES,
            f"parallel.tensor.mode must be 1d, 2d or 2.5d, got {self.mode!r}",
        )
        _require(self.size >= 1 and self.q >= 1 and self.d >= 1, "parallel.tensor sizes must be >= 1")

    @property
    def world_size(self) -> int:
        return tensor_world_size(dataclasses.asdict(self))


@dataclass(kw_only=True, slots=True)
class ParallelConfig:
    spill: SpillConfig | None = None
    offload: OffloadConfig | None = None
    pipeline: PipelineConfig | None = None
    tensor: TensorConfig | None = None
    data_parallel: int = 1

    def __post_init__(self) -> None:
        _require(
            self.data_parallel >= 1,
            f"parallel.data_parallel must be >= 1, got {self.data_parallel}",
        )

    @property
    def world_size(self) -> int:
        """Processes the job needs: pipeline stages x data-parallel replicas x tensor ranks."""
        return world_size(dataclasses.asdict(self))

    @property
    def axes(self) -> tuple[int, int, int]:
        """(pp, dp, tp) sizes of the world mesh."""
        return axis_sizes(dataclasses.asdict(self))


@dataclass(kw_only=True, slots=True)
class ResourceConfig:
    device: Literal["auto", "cpu", "cuda"] = "auto"
    gpus: int = 0


@dataclass(kw_only=True, slots=True)
class JobConfig:
    name: str = "job"
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    resources: ResourceConfig = field(default_factory=ResourceConfig)
    checkpoint_every: int = 0
    """Write a checkpoint every this many steps; 0 writes only at the end."""

    def __post_init__(self) -> None:
        _require(self.checkpoint_every >= 0, "checkpoint_every must be >= 0")
        # the same rules, and words, as the API's (jobrules/parallel.py)
        problems = parallel_problems(self.to_dict())
        _require(not problems, "; ".join(problems))

    @classmethod
    def from_dict(cls, spec: dict[str, Any]) -> JobConfig:
        """Build from a JobSpec dict; unknown keys are errors (a typo should not be ignored)."""
        return _build(cls, spec, "")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


_NESTED: dict[tuple[type, str], type] = {
    (JobConfig, "model"): ModelConfig,
    (JobConfig, "data"): DataConfig,
    (JobConfig, "train"): TrainConfig,
    (JobConfig, "parallel"): ParallelConfig,
    (JobConfig, "resources"): ResourceConfig,
    (ParallelConfig, "spill"): SpillConfig,
    (ParallelConfig, "offload"): OffloadConfig,
    (ParallelConfig, "pipeline"): PipelineConfig,
    (ParallelConfig, "tensor"): TensorConfig,
}

# Keys the service keeps in the spec that the trainer does not act on.
_IGNORED = {(JobConfig, "priority"), (JobConfig, "max_runtime_s")}


def _build(cls: type, raw: Any, prefix: str) -> Any:
    if not isinstance(raw, dict):
        raise ConfigError(f"{prefix.rstrip('.') or 'spec'} must be an object")
    names = {f.name for f in dataclasses.fields(cls)}
    kwargs: dict[str, Any] = {}
    for key, value in raw.items():
        if (cls, key) in _IGNORED:
            continue
        if key not in names:
            raise ConfigError(f"{prefix}{key} is not a known field")
        sub = _NESTED.get((cls, key))
        if sub is not None and value is not None:
            value = _build(sub, value, f"{prefix}{key}.")
        kwargs[key] = value
    try:
        return cls(**kwargs)
    except TypeError as e:  # a required field is missing
        raise ConfigError(f"{prefix.rstrip('.') or 'spec'}: {e}") from e
