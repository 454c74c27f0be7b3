"""Typed configuration of one training job, parsed from the JobSpec JSON.

The REST layer validates the same shape with pydantic (api/schemas.py); these dataclasses are the
trainer's own checks, so `python -m trainer --spec job.json` refuses a bad spec without the service.
Every message carries the numbers that broke the rule.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal

from jobrules.data import data_problems, data_vocab_size, vocab_problem
from jobrules.models import model_problems
from jobrules.parallel import (
    SCHEDULES,
    TENSOR_MODES,
    axis_sizes,
    parallel_problems,
    tensor_world_size,
    world_size,
)

ModelKind = Literal["gpt", "mlp", "llama", "python"]
DataKind = Literal["text", "tokens", "python"]
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
    """`gpt` (decoder-only transformer), `mlp` (position-wise MLP), `llama` (RMSNorm, rotary
    positions, SwiGLU, grouped-query attention) or `python` (a recipe from the workspace)."""
    layers: int = 4
    """Number of transformer blocks (gpt, llama) or hidden layers (mlp)."""
    d_model: int = 128
    """Hidden size."""
    heads: int = 4
    """Attention heads (gpt, llama); must divide d_model."""
    kv_heads: int | None = None
    """llama: key/value heads of grouped-query attention (must divide heads); None means heads."""
    seq_len: int = 64
    """Context length in tokens."""
    vocab_size: int | None = None
    """None follows the data's vocabulary; a number must hold every token id of the data."""
    mlp_ratio: int = 4
    """Width of the feed-forward layer as a multiple of d_model."""
    entry: str | None = None
    """python: `package.module:function` in the workspace returning a ModelRecipe."""
    args: dict[str, Any] = field(default_factory=dict)
    """python: keyword arguments for `entry` (a selection's search space can range over them)."""
    init_from: str | None = None
    """Initial weights: a safetensors or torch state-dict file (absolute, or in the workspace)."""

    def __post_init__(self) -> None:
        problems = model_problems(dataclasses.asdict(self))
        _require(not problems, "; ".join(problems))


@dataclass(kw_only=True, slots=True)
class DataConfig:
    kind: DataKind = "text"
    """`text` (a corpus tokenized at start), `tokens` (pre-tokenized train.bin/val.bin read through
    memory maps) or `python` (an entry point in the workspace returning batch iterables)."""
    corpus: Literal["stdlib"] | None = None
    """text: `stdlib` (the Python standard library's own source files); the default without `path`."""
    path: str | None = None
    """text: a UTF-8 file or a folder of them; tokens: the folder holding train.bin and val.bin.
    Absolute on the workers, or relative to the job's workspace."""
    tokenizer: str = "char"
    """text: `char` (ASCII code points, vocabulary 128), `byte` (UTF-8 bytes, 256) or the path of a
    Hugging Face `tokenizers` JSON file (absolute, or relative to the workspace)."""
    dtype: Literal["uint16", "uint32"] = "uint16"
    """tokens: the element type of train.bin and val.bin."""
    vocab_size: int | None = None
    """tokens/python: the data's vocabulary (token ids are < vocab_size); tokens without it scans
    the files once (streaming) for the largest id."""
    entry: str | None = None
    """python: `package.module:function` in the workspace, called with batch_size, seq_len, seed and
    `args`, returning (train, val) iterables of (inputs, targets) batches."""
    args: dict[str, Any] = field(default_factory=dict)
    """python: extra keyword arguments for `entry`."""
    max_chars: int = 4_000_000
    """text: cap on the characters read (keeps start-up fast)."""
    val_fraction: float = 0.1
    """text: held-out tail of the corpus used for validation loss."""

    def __post_init__(self) -> None:
        problems = data_problems(dataclasses.asdict(self))
        _require(not problems, "; ".join(problems))

    @property
    def known_vocab_size(self) -> int | None:
        """The vocabulary when it is known without reading files (None: only the trainer can tell)."""
        return data_vocab_size(dataclasses.asdict(self))


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
class EnvConfig:
    pip: list[str] = field(default_factory=list)
    """The job's own requirements, as lines of a requirements.txt (jobrules/pyenv.py). The worker
    builds them (with the workspace's requirements.txt) into an environment layered over the
    trainer's packages and passes its folder with --pyenv; the trainer only checks their shape."""

    def __post_init__(self) -> None:
        _require(
            isinstance(self.pip, list) and all(isinstance(x, str) for x in self.pip),
            "env.pip must be a list of requirement strings",
        )


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
    workspace: str | None = None
    """The uploaded workspace (`sha256:<digest>` or an id); the worker unpacks it and passes its
    folder to the trainer with --workspace."""
    env: EnvConfig = field(default_factory=EnvConfig)
    """The job's own Python requirements (the worker installs them; see EnvConfig)."""

    def __post_init__(self) -> None:
        _require(self.checkpoint_every >= 0, "checkpoint_every must be >= 0")
        problem = vocab_problem(model_vocab=self.model.vocab_size, data_vocab=self.data.known_vocab_size)
        _require(problem is None, problem or "")
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
    (JobConfig, "env"): EnvConfig,
    (ParallelConfig, "spill"): SpillConfig,
    (ParallelConfig, "offload"): OffloadConfig,
    (ParallelConfig, "pipeline"): PipelineConfig,
    (ParallelConfig, "tensor"): TensorConfig,
}

# Keys the service keeps in the spec that the trainer does not act on.
_IGNORED = {(JobConfig, "priority"), (JobConfig, "max_runtime_s"), (JobConfig, "max_restarts")}


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
