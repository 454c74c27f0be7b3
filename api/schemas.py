"""Request and response models. JobSpec mirrors trainer/config.py's JobConfig (the trainer checks
again on its side); every rule's message names the field and the numbers."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, StringConstraints, model_validator

from api import sizing
from jobrules.data import data_problems, data_vocab_size, vocab_problem, workspace_problems
from jobrules.models import model_problems
from jobrules.parallel import tensor_world_size, world_size
from jobrules.restarts import DEFAULT_MAX_RESTARTS, MAX_RESTARTS_LIMIT

WORKSPACE_REF = r"^(sha256:[0-9a-f]{64}|[0-9]{1,18})$"


class Strict(BaseModel):
    # NaN and Infinity parse from JSON (Python's json accepts them) but no field means them
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


NO_CONTROLS = r"^[^\x00-\x1f\x7f-\x9f\u200e\u200f\u202a-\u202e\u2066-\u2069\u2028\u2029]+$"
"""No control characters (C0, DEL, C1), line separators or bidirectional overrides: they break logs
and tables, or make a name print as another."""


def _not_blank(value: str) -> str:
    if not value.strip():
        raise ValueError("must hold a character other than spaces")
    return value


Name = Annotated[
    str, StringConstraints(min_length=1, max_length=200, pattern=NO_CONTROLS), AfterValidator(_not_blank)
]
"""A display name: 1-200 characters, not only spaces, no control characters (`NO_CONTROLS`).
Markup characters (`[/]`, `<b>`) are allowed: every place that prints a name prints it as text."""
DB_INT = 2**31 - 1
"""The largest value an INTEGER column holds on Postgres; ids and counters stay below it."""
DB_BIGINT = 2**63 - 1


class ModelSpec(Strict):
    kind: Literal["gpt", "mlp", "llama", "python"] = "gpt"
    layers: int = Field(4, ge=1, le=256)
    d_model: int = Field(128, ge=8, le=16384)
    heads: int = Field(4, ge=1, le=256)
    kv_heads: int | None = Field(None, ge=1, le=256, description="llama: grouped-query key/value heads")
    seq_len: int = Field(64, ge=1, le=8192)
    vocab_size: int | None = Field(None, ge=2, le=2**24, description="None follows the data's vocabulary")
    mlp_ratio: int = Field(4, ge=1, le=16)
    entry: str | None = Field(None, max_length=300, description="python: 'package.module:function'")
    args: dict[str, Any] = Field(default_factory=dict, description="python: keyword arguments for entry")
    init_from: str | None = Field(None, max_length=1000, description="safetensors/torch weights file")

    @model_validator(mode="after")
    def _rules(self) -> ModelSpec:
        problems = model_problems(self.model_dump())
        if problems:
            raise ValueError("; ".join(problems))
        return self


class DataSpec(Strict):
    kind: Literal["text", "tokens", "python"] = "text"
    corpus: Literal["stdlib"] | None = None
    path: str | None = Field(None, min_length=1, max_length=1000)
    tokenizer: str = Field("char", min_length=1, max_length=1000)
    dtype: Literal["uint16", "uint32"] = "uint16"
    vocab_size: int | None = Field(None, ge=2, le=2**24)
    entry: str | None = Field(None, max_length=300)
    args: dict[str, Any] = Field(default_factory=dict)
    max_chars: int = Field(4_000_000, ge=10_000, le=200_000_000)
    val_fraction: float = Field(0.1, gt=0.0, lt=0.5)

    @model_validator(mode="after")
    def _rules(self) -> DataSpec:
        problems = data_problems(self.model_dump())
        if problems:
            raise ValueError("; ".join(problems))
        return self


class TrainSpec(Strict):
    steps: int = Field(200, ge=1, le=10_000_000)
    batch_size: int = Field(16, ge=1, le=65536)
    lr: float = Field(3e-4, gt=0.0, le=10.0)
    optimizer: Literal["adamw", "sgd"] = "adamw"
    weight_decay: float = Field(0.0, ge=0.0, le=1.0)
    momentum: float = Field(0.0, ge=0.0, lt=1.0)
    seed: int = Field(0, ge=0, le=2**31 - 1)
    eval_every: int = Field(25, ge=1, le=10_000_000)
    eval_batches: int = Field(4, ge=1, le=1000)
    grad_clip: float = Field(0.0, ge=0.0, le=1e6)


class SpillSpec(Strict):
    device_budget_mb: float = Field(gt=0, le=1e9)
    prefetch: bool = True
    cuts: list[int] | None = Field(None, max_length=1024)


class OffloadSpec(Strict):
    optimizer: bool = False
    dtype: Literal["bf16", "fp16", "fp32"] = "bf16"


class PipelineSpec(Strict):
    stages: int = Field(2, ge=1, le=64)
    microbatches: int = Field(4, ge=1, le=4096)
    schedule: Literal["gpipe", "1f1b", "chimera", "chimera-zb", "async"] = "1f1b"


class TensorSpec(Strict):
    mode: Literal["1d", "2d", "2.5d"] = "1d"
    size: int = Field(1, ge=1, le=512)
    q: int = Field(1, ge=1, le=64)
    d: int = Field(1, ge=1, le=64)

    @property
    def world_size(self) -> int:
        return tensor_world_size(self.model_dump())


class ParallelSpec(Strict):
    spill: SpillSpec | None = None
    offload: OffloadSpec | None = None
    pipeline: PipelineSpec | None = None
    tensor: TensorSpec | None = None
    data_parallel: int = Field(1, ge=1, le=1024)

    @property
    def world_size(self) -> int:
        """pipeline stages x data_parallel x tensor ranks (jobrules/parallel.py)."""
        return world_size(self.model_dump())


class ResourceSpec(Strict):
    device: Literal["auto", "cpu", "cuda"] = "auto"
    gpus: int = Field(0, ge=0, le=1024)


class JobSpec(Strict):
    """A training job. See README.md for every field."""

    name: Name = "job"
    model: ModelSpec = Field(default_factory=ModelSpec)
    data: DataSpec = Field(default_factory=DataSpec)
    train: TrainSpec = Field(default_factory=TrainSpec)
    parallel: ParallelSpec = Field(default_factory=ParallelSpec)
    resources: ResourceSpec = Field(default_factory=ResourceSpec)
    checkpoint_every: int = Field(0, ge=0, le=10_000_000)
    priority: int = Field(0, ge=-100, le=100)
    workspace: str | None = Field(
        None,
        pattern=WORKSPACE_REF,
        description="an uploaded workspace: its id or 'sha256:<digest>' (POST /api/workspaces)",
    )
    max_runtime_s: int | None = Field(
        None, ge=1, le=30 * 24 * 3600, description="the worker fails the job when it runs longer"
    )
    max_restarts: int = Field(
        DEFAULT_MAX_RESTARTS,
        ge=0,
        le=MAX_RESTARTS_LIMIT,
        description="attempts that fail for the infrastructure (a rank killed by a signal, a lost "
        "worker) are retried from the checkpoint this many times; the job's own failures never are",
    )

    @model_validator(mode="after")
    def _cross_field(self) -> JobSpec:
        spec = self.model_dump()
        problems = workspace_problems(
            model=spec["model"], data=spec["data"], has_workspace=self.workspace is not None
        )
        vocab = vocab_problem(model_vocab=self.model.vocab_size, data_vocab=data_vocab_size(spec["data"]))
        if vocab:
            problems.append(vocab)
        problems += sizing.spec_problems(spec)
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


class ReservationPublic(BaseModel):
    worker: str
    node_rank: int
    nnodes: int
    slots: int
    gpus: int
    ram_bytes: int
    claimed: bool
    """The node's task has started (claimed the reservation)."""


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
    owner: str | None
    wait_reason: str | None
    """Why a queued job has not started: the scheduler's reason (workers busy, too small, quota,
    behind a higher-priority job, no live worker)."""
    queue_position: int | None = None
    """1-based place of a queued job in the scheduler's order (None when not queued)."""
    reservation: list[ReservationPublic] = []
    """The slots the scheduler reserved for the job, one entry per node (worker)."""
    run_seconds: float = 0.0
    """Wall time its attempts have run so far (max_runtime_s counts all of it)."""
    restarts: int = 0
    """Attempts that failed for the infrastructure and were retried (the spec's max_restarts
    bounds it); each one's reason is in the job's events."""


class QueueEntry(BaseModel):
    position: int
    """1-based, in the scheduler's order among all queued jobs."""
    job_id: int
    name: str
    owner: str | None
    priority: int
    effective_priority: int
    """priority plus one for every aging_s the job has waited."""
    world_size: int
    waited_s: float
    wait_reason: str | None
    selection_id: int | None = None
    """Set when the entry is one group of a selection batch's trials: `job_id` is its first
    trial's job and `world_size` the batch's devices (the group runs on one worker)."""
    trial_ids: list[int] = []
    """The group's trials (empty for a job)."""


class QueuePublic(BaseModel):
    items: list[QueueEntry]
    total: int
    """Queued jobs in all (a user sees only their own entries, with their global positions)."""


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
    host: dict[str, int]
    """What admission and the scheduler compare jobs with: ram_bytes, slots (rank slots), cpus,
    tasks (jobs at once: the Celery concurrency), and draining (1 while it shuts down warm)."""
    last_seen: datetime


class HealthPublic(BaseModel):
    status: Literal["ok", "degraded"]
    db: dict[str, Any]
    broker: dict[str, Any]
    workers: list[WorkerPublic]


# ---- selections -------------------------------------------------------------------------------


class EarlyStoppingSpec(Strict):
    """Rungs at min_steps * reduction_factor**k steps (trainer/selection/halving.py): `asha`
    promotes as results come in, `sha` decides each rung once it is full, `hyperband` runs SHA
    brackets that start at different rungs. Decisions follow the batch's seed, never timing."""

    kind: Literal["asha", "sha", "hyperband"] = "asha"
    reduction_factor: int = Field(3, ge=2, le=16)
    min_steps: int = Field(1, ge=1, le=10_000_000)


class SelectionCreate(Strict):
    """A model-selection batch: trials of `base` over `space`."""

    name: Name = "selection"
    base: JobSpec
    space: dict[str, Any] = Field(
        min_length=1, description="dotted JobSpec path -> list or {low, high, log, int, num}"
    )
    method: Literal["grid", "random", "tpe", "cmaes", "qmc"] = Field(
        "random",
        description="grid or random expand the space at submit; tpe, cmaes and qmc are Optuna "
        "samplers that grow the batch a generation of `parallel` trials at a time",
    )
    trials: int | None = Field(
        None, ge=1, le=1024, description="how many (random and the samplers; grid sets its own)"
    )
    seed: int = Field(0, ge=0, le=DB_INT)
    parallel: int | None = Field(
        None, ge=1, le=1024, description="samplers only: trials asked per generation (default: devices)"
    )
    startup_trials: int | None = Field(
        None, ge=1, le=1024, description="tpe and cmaes: random trials before the model (Optuna's default 10)"
    )
    checkpoints: Literal["best", "all", "none"] = Field(
        "best", description="end-of-trial checkpoints kept: the best trial's, every trial's, or none"
    )
    metric: str = Field("val_loss", pattern="^(val_loss|loss)$")
    mode: Literal["min", "max"] = "min"
    scheduler: Literal["shard-lrtf", "fifo", "round-robin", "sequential"] = "shard-lrtf"
    devices: int = Field(2, ge=1, le=64, description="devices of one worker the batch alternates over")
    group_size: int = Field(16, ge=1, le=1024, description="trials per worker group; more are split")
    early_stopping: EarlyStoppingSpec | None = None

    @model_validator(mode="after")
    def _method_fields(self) -> SelectionCreate:
        sampler = self.method in ("tpe", "cmaes", "qmc")
        if not sampler:
            for name in ("parallel", "startup_trials"):
                if getattr(self, name) is not None:
                    raise ValueError(
                        f"{name} is for the samplers (tpe, cmaes, qmc), not method {self.method}"
                    )
        elif self.trials is None:
            raise ValueError(f"method {self.method} needs trials (how many in all)")
        if self.startup_trials is not None and self.method == "qmc":
            raise ValueError("startup_trials is for tpe and cmaes; qmc has no model to start")
        return self

    @property
    def generation(self) -> int:
        """Samplers: trials asked at once (`parallel`, default one per device)."""
        return self.parallel or self.devices


class TrialsAdd(Strict):
    """Trials to add to a batch: explicit params, or more samples of the batch's own space."""

    params: list[dict[str, Any]] | None = Field(None, min_length=1, max_length=1024)
    trials: int | None = Field(None, ge=1, le=1024, description="more random samples of the batch's space")
    warm_start_from: int | None = Field(
        None, ge=1, le=DB_INT, description="trial id whose latest checkpoint seeds the new trials"
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
    error: str | None = None
    """Why the batch could not do all it was asked (a sampler that could not ask its next trials)."""
    trials: list[TrialPublic]
    leaderboard: list[int]
    """Trial ids with a metric, best first."""
    owner: str | None


class SelectionsPublic(BaseModel):
    items: list[SelectionPublic]
    total: int


# ---- workspaces -------------------------------------------------------------------------------


class WorkspacePublic(BaseModel):
    id: int
    ref: str
    """`sha256:<digest>`: what a JobSpec's `workspace` may name (the id works too)."""
    digest: str
    size: int
    name: str
    format: str
    created_at: datetime
    owner_id: int | None


class WorkspacesPublic(BaseModel):
    items: list[WorkspacePublic]
    total: int
