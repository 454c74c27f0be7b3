"""Every request the service takes, defined once: the JobSpec (a training job) and the selection
request (a batch of trials). pydantic models with every field's default, bound and allowed value;
the cross-field rules are the functions of this package (models, data, parallel, sizing, pyenv).

The API answers 422 from these models and `python -m trainer --spec` exits 2 from the same ones,
with the same sentences: `explain` formats a validation error as "field: message" for both. The
trainer runs on the validated models themselves (trainer/config.py names them).

Two rules depend on where a spec is checked, and are passed in pydantic's validation context:
`workspace` (the trainer was given a workspace folder, so relative paths and user code resolve in
it) and `pip_options` (the admin lets env.pip hold pip options; the API reads the setting through
`pip_options_allowed`, the trainer accepts what its worker already vetted).

A spec the service stored (a job's, a trial's, a batch's request) is read through these models too,
never as a dict by string key: `stored` builds the model from the stored document without judging
it again (`stored_job` for a JobSpec), so the workers, the scheduler and the quotas read typed fields
with the model's defaults.
"""

from __future__ import annotations

import unicodedata
from collections.abc import Callable, Mapping
from typing import Annotated, Any, Literal, TypeVar, get_args

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    StringConstraints,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from jobrules.data import data_problems, data_vocab_size, vocab_problem, workspace_problems
from jobrules.divergence import DEFAULT_DIVERGENCE_FACTOR
from jobrules.models import ModelKind, model_problems
from jobrules.parallel import (
    Schedule,
    TensorMode,
    axis_sizes,
    checkpoint_pieces,
    spill_state_on_host,
    tensor_world_size,
    world_size,
)
from jobrules.pyenv import MAX_LINE_CHARS, MAX_LINES, installed_versions, requirement_problems
from jobrules.restarts import DEFAULT_MAX_RESTARTS, MAX_RESTARTS_LIMIT
from jobrules.sizing import spec_problems
from jobrules.user_metrics import RANKED_BUILT_IN, ranked_metric_problem

WORKSPACE_REF = r"^(sha256:[0-9a-f]{64}|[0-9]{1,18})$"
MAX_PROBLEMS = 20
"""At most this many problems are listed in one refusal."""
MAX_MESSAGE = 1000
MAX_DETAIL = 4000


def _refuse(problems: list[str]) -> None:
    """A validator's refusal: every problem in one ValueError, none when there are none."""
    if problems:
        raise ValueError("; ".join(problems))


pip_options_allowed: Callable[[], bool] = lambda: False  # noqa: E731 - the API installs its setting
"""Whether env.pip may hold pip options when the validation context does not say; the API sets it
to read `pyenv_allow_options` (jobrules reads no settings of its own)."""


class SpecError(ValueError):
    """A request that can never run; the message names each field and its rule."""


class Strict(BaseModel):
    # NaN and Infinity parse from JSON (Python's json accepts them) but no field means them
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


def _context(info: ValidationInfo, key: str) -> Any:
    return (info.context or {}).get(key)


NO_CONTROLS = r"^[^\x00-\x1f\x7f-\x9f\u200e\u200f\u202a-\u202e\u2066-\u2069\u2028\u2029]+$"
"""No control characters (C0, DEL, C1), line separators or bidirectional overrides: they break logs
and tables, or make a name print as another."""


INVISIBLE_CATEGORIES = frozenset({"Cf", "Zs", "Cc"})
"""Unicode categories that print as nothing: format characters (zero-width spaces and joiners, a
byte order mark), space separators (the no-break and ideographic spaces among them), controls."""


def blank(value: str) -> bool:
    """`value` prints as nothing: empty once whitespace and the INVISIBLE_CATEGORIES are taken out
    (a name of zero-width spaces could be neither read nor told from another)."""
    return all(c.isspace() or unicodedata.category(c) in INVISIBLE_CATEGORIES for c in value)


def _not_blank(value: str) -> str:
    if blank(value):
        raise ValueError(
            "must hold a visible character: it is empty once spaces and invisible characters "
            "(Unicode categories Cf, Zs, Cc: zero-width spaces, no-break spaces, controls) are taken out"
        )
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
    kind: ModelKind = "gpt"
    """`gpt` (decoder-only transformer), `mlp` (position-wise MLP), `llama` (RMSNorm, rotary
    positions, SwiGLU, grouped-query attention) or `python` (a recipe from the workspace)."""
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
        _refuse(model_problems(self.model_dump()))
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
        _refuse(data_problems(self.model_dump()))
        return self

    @property
    def known_vocab_size(self) -> int | None:
        """The vocabulary when it is known without reading files (None: only the trainer can tell)."""
        return data_vocab_size(self.model_dump())


class TrainSpec(Strict):
    steps: int = Field(200, ge=1, le=10_000_000)
    batch_size: int = Field(16, ge=1, le=65536)
    """Sequences per step (the global batch)."""
    lr: float = Field(3e-4, gt=0.0, le=10.0)
    optimizer: Literal["adamw", "sgd"] = "adamw"
    weight_decay: float = Field(0.0, ge=0.0, le=1.0)
    momentum: float = Field(0.0, ge=0.0, lt=1.0)
    seed: int = Field(0, ge=0, le=2**31 - 1)
    eval_every: int = Field(25, ge=1, le=10_000_000)
    """Validation loss every this many steps (and at the last step)."""
    eval_batches: int = Field(4, ge=1, le=1000)
    grad_clip: float = Field(0.0, ge=0.0, le=1e6)
    """Clip the global gradient norm to this value; 0 disables."""
    divergence_factor: float = Field(DEFAULT_DIVERGENCE_FACTOR, gt=1.0, le=1e9)
    """The run is flagged diverged when its final smoothed loss is above this many times its first
    loss (jobrules/divergence.py)."""
    fail_on_divergence: bool = False
    """A diverged run ends `failed` with the divergence as its error, instead of `succeeded` with
    the flag."""


class SpillSpec(Strict):
    device_budget_mb: float = Field(gt=0, le=1e9)
    prefetch: bool = True
    cuts: list[int] | None = Field(None, max_length=1024)
    optimizer: Literal["auto", "device", "host"] = Field(
        "auto",
        description="where a spilled shard's optimizer state lives and steps: 'host' (it stays in "
        "host memory and the CPU steps it; only weights come in and gradients go out), 'device' "
        "(it travels in and out with the shard), or 'auto': host, unless parallel.offload.optimizer "
        "streams the state or the job is a selection batch's trial",
    )


class OffloadSpec(Strict):
    optimizer: bool = False
    dtype: Literal["bf16", "fp16", "fp32"] = "bf16"


class PipelineSpec(Strict):
    stages: int = Field(2, ge=1, le=64)
    microbatches: int = Field(4, ge=1, le=4096)
    schedule: Schedule = "1f1b"


class TensorSpec(Strict):
    mode: TensorMode = "1d"
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

    @property
    def axes(self) -> tuple[int, int, int]:
        """(pp, dp, tp) sizes of the world mesh."""
        return axis_sizes(self.model_dump())

    @property
    def checkpoint_pieces(self) -> int:
        """Files one checkpoint is written as (jobrules/parallel.py)."""
        return checkpoint_pieces(self.model_dump())

    @property
    def spill_state_on_host(self) -> bool:
        """Whether a spilled job keeps its optimizer state on the host (jobrules/parallel.py)."""
        return spill_state_on_host(self.model_dump())


class ResourceSpec(Strict):
    device: Literal["auto", "cpu", "cuda"] = "auto"
    gpus: int = Field(0, ge=0, le=1024)

    @property
    def gpus_held(self) -> int:
        """GPUs the job holds: `gpus`, at least one when it asks for the cuda device."""
        return max(self.gpus, 1 if self.device == "cuda" else 0)


class EnvSpec(Strict):
    pip: list[Annotated[str, StringConstraints(min_length=1, max_length=MAX_LINE_CHARS)]] = Field(
        default_factory=list,
        max_length=MAX_LINES,
        description="the job's own Python requirements, as requirements.txt lines ('einops==0.8.2')",
    )

    @model_validator(mode="after")
    def _rules(self, info: ValidationInfo) -> EnvSpec:
        lines = [(f"env.pip[{i}]", x) for i, x in enumerate(self.pip)]
        allow = _context(info, "pip_options")
        allow = pip_options_allowed() if allow is None else allow
        _refuse(requirement_problems(lines, installed=installed_versions(), allow_options=allow))
        return self


class JobSpec(Strict):
    """A training job. See README.md for every field."""

    name: Name = "job"
    model: ModelSpec = Field(default_factory=ModelSpec)
    data: DataSpec = Field(default_factory=DataSpec)
    train: TrainSpec = Field(default_factory=TrainSpec)
    parallel: ParallelSpec = Field(default_factory=ParallelSpec)
    resources: ResourceSpec = Field(default_factory=ResourceSpec)
    checkpoint_every: int = Field(0, ge=0, le=10_000_000)
    """Write a checkpoint every this many steps; 0 writes only at the end."""
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
    env: EnvSpec | None = Field(
        None,
        description="Python packages the job needs beyond the trainer's (with a workspace's requirements.txt)",
    )

    @model_validator(mode="after")
    def _cross_field(self, info: ValidationInfo) -> JobSpec:
        spec = self.model_dump()
        # the trainer given a workspace folder resolves user code and relative paths in it
        has_workspace = self.workspace is not None or bool(_context(info, "workspace"))
        problems = workspace_problems(model=spec["model"], data=spec["data"], has_workspace=has_workspace)
        vocab = vocab_problem(model_vocab=self.model.vocab_size, data_vocab=data_vocab_size(spec["data"]))
        if vocab:
            problems.append(vocab)
        _refuse(problems + spec_problems(spec))
        return self

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump()

    @property
    def queue(self) -> str:
        return "gpu" if self.gpus else "cpu"

    @property
    def requirements(self) -> list[str]:
        """The job's own requirement lines (`env.pip`); none without `env`."""
        return self.env.pip if self.env is not None else []

    @property
    def gpus(self) -> int:
        """GPUs the job holds (ResourceSpec.gpus_held)."""
        return self.resources.gpus_held


# ---- selections -------------------------------------------------------------------------------

SchedulerName = Literal["shard-lrtf", "fifo", "round-robin", "sequential"]
SCHEDULERS: tuple[SchedulerName, ...] = get_args(SchedulerName)
"""How a node's devices pick the next trial shard (trainer/selection/policy.py)."""
StoppingKind = Literal["asha", "sha", "hyperband"]
STOPPING_KINDS: tuple[StoppingKind, ...] = get_args(StoppingKind)
CheckpointPolicy = Literal["best", "all", "none"]
CHECKPOINT_POLICIES: tuple[CheckpointPolicy, ...] = get_args(CheckpointPolicy)
Method = Literal["grid", "random", "tpe", "cmaes", "qmc"]
METHODS: tuple[Method, ...] = get_args(Method)
SAMPLERS = ("tpe", "cmaes", "qmc")
"""`method` values an Optuna sampler serves (core/search.py); grid and random expand at submit."""


class EarlyStoppingSpec(Strict):
    """Rungs at min_steps * reduction_factor**k steps (trainer/selection/halving.py): `asha`
    promotes as results come in, `sha` decides each rung once it is full, `hyperband` runs SHA
    brackets that start at different rungs. Decisions follow the batch's seed, never timing."""

    kind: StoppingKind = "asha"
    reduction_factor: int = Field(3, ge=2, le=16)
    min_steps: int = Field(1, ge=1, le=10_000_000)


class BatchRules(Strict):
    """How a selection batch's trials are run and ranked: fields of the request that the worker
    hands on to the trainer's executor unchanged (SelectionCreate and SelectionBatch share them)."""

    seed: int = Field(0, ge=0, le=DB_INT)
    checkpoints: CheckpointPolicy = Field(
        "best", description="end-of-trial checkpoints kept: the best trial's, every trial's, or none"
    )
    metric: str = Field(
        "val_loss",
        max_length=64,
        description="what ranks the trials: val_loss, loss, or the name of a metric the trials' own "
        "code reports (trainer/report.py), with `mode` saying which way is better",
    )
    mode: Literal["min", "max"] = "min"
    scheduler: SchedulerName = "shard-lrtf"
    early_stopping: EarlyStoppingSpec | None = None
    fuse: bool = Field(
        True,
        description="train trials of one architecture as stacked models (horizontal fusion, "
        "trainer/selection/fused.py) where a short measurement says it shortens the batch; false: "
        "every trial alone",
    )
    """Horizontal fusion, on unless asked off: the trials of a group that share an architecture,
    data shape, batch size and optimizer may train as stacked models, each member's losses those of
    its run alone; a cost model measured at the start picks the stacks and their devices, and
    leaves every trial alone when stacking would not shorten the batch. A sampler's batch (its
    trials start one by one) never fuses; with early stopping, only a batch whose every trial can
    train in a stack does."""

    @field_validator("metric")
    @classmethod
    def _metric_name(cls, v: str) -> str:
        problem = ranked_metric_problem(v)
        if problem is not None:
            raise ValueError(problem)
        return v

    @classmethod
    def rules_of(cls, request: dict[str, Any]) -> dict[str, Any]:
        """The BatchRules fields of a stored request (absent ones take their defaults)."""
        return {k: request[k] for k in BatchRules.model_fields if k in request}


HOST_STEPS_IN_A_BATCH = (
    'parallel.spill.optimizer "host" is for single jobs: a selection batch moves each trial\'s shards '
    "between its devices with their optimizer state, and steps them there"
)


class SelectionCreate(BatchRules):
    """A model-selection batch: trials of `base` over `space`."""

    name: Name = "selection"
    base: JobSpec
    space: dict[str, Any] = Field(
        min_length=1, description="dotted JobSpec path -> list or {low, high, log, int, num}"
    )
    method: Method = Field(
        "random",
        description="grid or random expand the space at submit; tpe, cmaes and qmc are Optuna "
        "samplers that keep `parallel` trials in flight, asking a new one as each ends",
    )
    trials: int | None = Field(
        None, ge=1, le=1024, description="how many (random and the samplers; grid sets its own)"
    )
    parallel: int | None = Field(
        None, ge=1, le=1024, description="samplers only: trials in flight at once (default: devices)"
    )
    startup_trials: int | None = Field(
        None, ge=1, le=1024, description="tpe and cmaes: random trials before the model (Optuna's default 10)"
    )
    devices: int = Field(2, ge=1, le=64, description="devices of one worker the batch alternates over")
    group_size: int = Field(16, ge=1, le=1024, description="trials per worker group; more are split")

    @model_validator(mode="after")
    def _method_fields(self) -> SelectionCreate:
        spill = self.base.parallel.spill
        if spill is not None and spill.optimizer == "host":
            raise ValueError(HOST_STEPS_IN_A_BATCH)
        if self.metric not in RANKED_BUILT_IN and "python" not in (self.base.model.kind, self.base.data.kind):
            raise ValueError(
                f"metric {self.metric!r}: only a workspace's own code reports metrics of its own "
                "(model.kind or data.kind python, trainer/report.py); the built-in models and data "
                f"report {' and '.join(RANKED_BUILT_IN)}"
            )
        sampler = self.method in SAMPLERS
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


class BatchTrial(Strict):
    index: int = Field(ge=0)
    spec: dict[str, Any]
    """The trial's JobSpec, checked when the trial starts: a bad one fails that trial alone."""
    warm_start: str | None = None
    """A checkpoint (file or folder) whose weights the trial starts from."""


class SelectionBatch(BatchRules):
    """The message a worker hands a selection group's executor (`python -m trainer.selection
    --batch`): the group's trials and the request's BatchRules."""

    trials: list[BatchTrial] = Field(min_length=1)
    prefetch: bool = True
    """Copy the next chosen trial's shard in while the current one computes."""
    device_budget_mb: float | None = Field(None, gt=0)
    """Each device's ledger budget; None: unlimited (CPU devices)."""

    @model_validator(mode="after")
    def _unique(self) -> SelectionBatch:
        indices = [t.index for t in self.trials]
        if len(set(indices)) != len(indices):
            raise ValueError(f"trials indices must be unique, got {indices}")
        return self


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


# ---- refusals -----------------------------------------------------------------------------------


def clip(text: str, limit: int) -> str:
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def field_name(loc: tuple[Any, ...]) -> str:
    """A pydantic error location as a dotted field name; the request body itself is `body`. Only
    the first part says where in the request (FastAPI's body, query, path or header): a field may
    be called `path` too (data.path)."""
    if loc and loc[0] in ("body", "query", "path", "header"):
        loc = loc[1:]
    return ".".join(clip(str(p), 64) for p in loc) or "body"


def problems(errors: list[Any]) -> list[dict[str, str]]:
    """pydantic's errors as {field, message, type}, at most MAX_PROBLEMS; the input is never echoed
    (it may be megabytes)."""
    out = []
    for err in errors[:MAX_PROBLEMS]:
        msg = clip(err["msg"].removeprefix("Value error, "), MAX_MESSAGE)
        field = field_name(tuple(err["loc"]))
        if err["type"] == "json_invalid":
            # FastAPI's loc is (body, the character's position): the body is the field
            where, why = err["loc"][-1], (err.get("ctx") or {}).get("error")
            field, msg = (
                "body",
                clip(f"not valid JSON at character {where}" + (f" ({why})" if why else ""), MAX_MESSAGE),
            )
        out.append({"field": field, "message": msg, "type": err["type"]})
    return out


def explain(errors: list[Any]) -> str:
    """One sentence per problem, "field: message", joined by "; " (the API's 422 detail and the
    trainer's exit-2 reason)."""
    return clip("; ".join(f"{e['field']}: {e['message']}" for e in problems(errors)), MAX_DETAIL)


M = TypeVar("M", bound=BaseModel)
J = TypeVar("J", bound=JobSpec)


def parse(model: type[M], raw: Any, *, context: dict[str, Any] | None = None) -> M:
    """Validate a request document against `model`; SpecError names each field and its rule, in
    the words of the API's 422."""
    try:
        return model.model_validate(raw, context=context)
    except ValidationError as e:
        raise SpecError(explain(e.errors())) from None


def parse_job(
    raw: Any,
    *,
    model: type[J] = JobSpec,  # type: ignore[assignment]  # J is JobSpec then
    workspace: bool = False,
    pip_options: bool | None = None,
) -> J:
    """Validate a JobSpec document. `workspace`: a workspace folder is given (relative paths and
    user code resolve there); `pip_options`: None asks `pip_options_allowed`."""
    context: dict[str, Any] = {"workspace": workspace}
    if pip_options is not None:
        context["pip_options"] = pip_options
    return parse(model, raw, context=context)


def stored(model: type[M], raw: Mapping[str, Any]) -> M:
    """A document the service stored, read as `model` without being judged again. A stored job was
    judged whole when the service took it, and what it was judged against (the packages installed
    there, the pip-options setting, a workspace's files) is not what the reader has; a sampler's
    trial is judged when it starts, where a bad one fails that trial alone, never its reader.
    Nested models are built the same way; keys the model does not name are left out, and
    `model_dump(exclude_unset=True)` gives back the document's known keys as they were."""
    values = {name: stored_field(model, raw, name) for name in model.model_fields if name in raw}
    return model.model_construct(_fields_set=set(values), **values)


def stored_field(model: type[BaseModel], raw: Mapping[str, Any], name: str) -> Any:
    """Field `name` of a stored `model` document as `stored` reads it (its default when absent),
    without building the rest: a path that runs per row (a quota check over the running jobs, the
    scheduler's needs) reads the one section it uses in microseconds, not a whole spec's models
    (about 60 us)."""
    field = model.model_fields[name]
    if name not in raw:
        return field.get_default(call_default_factory=True)
    value, inner = raw[name], _model_in(field.annotation)
    return stored(inner, value) if inner is not None and isinstance(value, Mapping) else value


def _model_in(annotation: Any) -> type[BaseModel] | None:
    """The model a field holds (`ParallelSpec`, `EnvSpec | None`), or None for a plain value."""
    for candidate in (annotation, *get_args(annotation)):
        if isinstance(candidate, type) and issubclass(candidate, BaseModel):
            return candidate
    return None


def stored_job(raw: Mapping[str, Any]) -> JobSpec:
    """A stored job (or trial) spec as a JobSpec: `stored`."""
    return stored(JobSpec, raw)
