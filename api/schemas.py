"""Response models, and the request models re-exported from jobrules/spec.py (their one
definition, which `python -m trainer` validates with too)."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    GetCoreSchemaHandler,
    SerializerFunctionWrapHandler,
    model_serializer,
)
from pydantic_core import CoreSchema, core_schema

import jobrules.spec
from core.settings import get_settings
from jobrules.spec import (  # noqa: F401 - the request models, re-exported for the routes
    DB_BIGINT,
    DB_INT,
    NO_CONTROLS,
    WORKSPACE_REF,
    DataSpec,
    EarlyStoppingSpec,
    EnvSpec,
    JobSpec,
    ModelSpec,
    Name,
    OffloadSpec,
    ParallelSpec,
    PipelineSpec,
    ResourceSpec,
    SelectionCreate,
    SpillSpec,
    Strict,
    TensorSpec,
    TrainSpec,
    TrialsAdd,
)
from jobrules.stopping import StopReason  # noqa: F401 - one definition with the trainer's

# env.pip may hold pip options only where the admin allows them
jobrules.spec.pip_options_allowed = lambda: get_settings().pyenv_allow_options


class PresentOnly(BaseModel):
    """A response body whose optional fields are left out when absent, rather than sent as null:
    the schema documents a dict the service builds, and the JSON stays that dict."""

    @model_serializer(mode="wrap")
    def _present_only(self, handler: SerializerFunctionWrapHandler):  # no return type: the model's own schema
        out = handler(self)
        keep = self.model_fields_set | set(self.model_extra or ())
        return {k: v for k, v in out.items() if k in keep}


class Stored:
    """`Annotated[dict[str, Any], Stored(Model)]`: a request document as a row stores it, documented
    as the request model it was submitted as (the schema, and the dashboard's types, refer to
    `Model`), but sent unchanged and never validated again: a spec stored by an older version may
    lack newer fields or break a rule added since, and must still read. It leans on how pydantic
    builds core schemas; tests/unit/test_api_types.py checks the result (the reference, the JSON)."""

    def __init__(self, model: type[BaseModel]) -> None:
        self.model = model

    def __get_pydantic_core_schema__(self, _source: Any, handler: GetCoreSchemaHandler) -> CoreSchema:
        model = handler.generate_schema(self.model)
        ref = model.get("ref") or model["schema_ref"]
        # metadata on the reference keeps the model a definition of its own (pydantic inlines a
        # definition used once), which the schema below refers to
        where = core_schema.definition_reference_schema(ref, metadata={"stored_as": self.model.__name__})
        return core_schema.any_schema(
            # the value itself is sent: no model serializer, no check
            serialization=core_schema.wrap_serializer_function_ser_schema(lambda v, _h: v, schema=where),
            # an annotation function: pydantic_js_functions would inline the model's schema
            metadata={"pydantic_js_annotation_functions": [lambda cs, h: h(cs["serialization"]["schema"])]},
        )


StoredJobSpec = Annotated[dict[str, Any], Stored(JobSpec)]
StoredSelectionCreate = Annotated[dict[str, Any], Stored(SelectionCreate)]


class FieldProblem(BaseModel):
    """One problem of a refused request."""

    field: str
    """The field, dotted (`train.lr`, `base.model.layers`, `limit`); `body` for the body itself."""
    message: str
    """The rule it breaks, in words."""
    type: str
    """pydantic's error type (`greater_than`, `missing`, `value_error`, ...)."""


class ValidationRefusal(BaseModel):
    """A 422: the request can never be done as sent. `detail` says "field: rule" for each problem,
    joined by "; "; `errors` lists them one by one (at most 20) when the request broke a declared
    rule, and is absent when a route's own check refused it (a trial that cannot run, a space
    that cannot be sampled: `detail` names the field)."""

    detail: str
    errors: list[FieldProblem] = Field(default_factory=list)
    """Absent when a route's own check refused the request."""


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
    spec: StoredJobSpec
    """The JobSpec as submitted and stored (with the defaults of its version filled in)."""
    cancel_requested: bool
    progress: Progress
    selection_id: int | None
    owner: str | None
    wait_reason: str | None
    """Why a queued job has not started: the scheduler's reason (workers busy, too small, quota,
    behind a higher-priority job, no live worker); for a running job, `preparing environment`
    while its worker builds (or waits for) the environment of its requirements."""
    queue_position: int | None = None
    """1-based place of a queued job in the scheduler's order (None when not queued)."""
    reservation: list[ReservationPublic] = []
    """The slots the scheduler reserved for the job, one entry per node (worker)."""
    run_seconds: float = 0.0
    """Wall time its attempts have run so far (max_runtime_s counts all of it)."""
    restarts: int = 0
    """Attempts that failed for the infrastructure and were retried (the spec's max_restarts
    bounds it); each one's reason is in the job's events."""
    diverged: bool = False
    """The run ended with its final smoothed training loss above train.divergence_factor times
    its first (jobrules/divergence.py); `divergence` says by how much."""
    divergence: str | None = None
    """Why the run counts as diverged, one sentence with the numbers; None when it did not."""
    stopped_early: bool = False
    """A trial's job: early stopping (ASHA rungs, the median rule) ended the trial before its last
    step. Its `status` is `succeeded` (it trained without fault); this says it was cut short."""
    stop_reason: StopReason | None = None
    """A trial stopped early: why (the rung, its metric and the cutoff), as its executor reported."""


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


class CurvesPublic(BaseModel):
    """One metric of every trial of a batch (GET /api/selections/{id}/curves): the batch page's
    curves in one answer rather than one request per trial."""

    selection_id: int
    name: str
    curves: dict[str, Series]
    """By the trial's job id (as a string: a JSON object's key); trials without the metric yet
    are absent."""


class EventPublic(BaseModel):
    id: int
    time: float
    kind: str
    message: str
    data: dict[str, Any] | None


class EventsPublic(BaseModel):
    items: list[EventPublic]


class TimelineAction(BaseModel):
    """One pipeline action on one rank, in seconds from the step's start."""

    rank: int
    op: Literal["F", "B", "W", "AR"]
    """F forward, B backward (input gradient when W is split off), W deferred weight gradient,
    AR the gradient all-reduce between Chimera's two copies of a stage."""
    mb: int | None
    """Micro-batch index; -1 for AR (it covers every micro-batch of the stage)."""
    stage: int | None
    replica: int | None
    start: float
    end: float


class TimelinePublic(BaseModel):
    """A pipeline job's executed and simulated per-rank timelines (the trainer's `timeline` event)."""

    schedule: str
    stages: int
    microbatches: int
    executed: list[TimelineAction]
    simulated: list[TimelineAction]
    """The same schedule simulated on the per-op costs measured in this job."""
    bubble_executed: float | None
    bubble_simulated: float | None
    peak_stash_simulated: list[int] | None = None
    """Per rank, the most activations stashed at once in the simulation."""


class WorkerPublic(BaseModel):
    name: str
    hostname: str
    queues: list[str]
    devices: list[dict[str, Any]]
    host: dict[str, int]
    """What admission and the scheduler compare jobs with: ram_bytes, slots (rank slots), cpus,
    tasks (jobs at once: the Celery concurrency), and draining (1 while it shuts down warm)."""
    last_seen: datetime
    sandbox: Literal["on", "off", "unavailable", "unknown"] = "unknown"
    """Whether its trainers run in their sandbox: on; off (its operator's SHARDYARD_SANDBOX=off);
    unavailable (it cannot make one, so it refuses jobs with users' code); unknown (an older worker)."""
    sandbox_why: str | None = None


class PoolUse(BaseModel):
    size: int
    checked_out: int
    """Pooled connections in use right now (open streams must not hold any while they wait)."""


class DbHealth(PresentOnly):
    ok: bool
    url: str | None = None
    """The database URL without its credentials."""
    pool: PoolUse | None = None
    error: str | None = None


class BrokerHealth(PresentOnly):
    ok: bool
    error: str | None = None


class HealthPublic(BaseModel):
    status: Literal["ok", "degraded"]
    db: DbHealth
    broker: BrokerHealth
    workers: list[WorkerPublic]
    sandbox: Literal["on", "off", "unavailable", "unknown"] = "unknown"
    """The live workers' sandbox, worst first: off when any runs users' code unsandboxed,
    unavailable when any cannot make one, on when every one does (docs/security.md)."""


# ---- selections -------------------------------------------------------------------------------


class TrialReport(PresentOnly):
    """The selection executor's report of one trial (a trial's `result`, and its job's). Every
    field may be absent (older reports, a trial that failed before it ran); only the fields present
    are sent, and any others the executor adds pass through."""

    model_config = ConfigDict(extra="allow")

    trial: int | None = None
    status: str | None = None
    steps: int | None = None
    metric: str | None = None
    last_metric: float | None = None
    best_metric: float | None = None
    stopped_early: bool | None = None
    stop_reason: StopReason | None = None
    error: str | None = None
    compute_s: float | None = None
    copy_s: float | None = None
    busy_s: float | None = None
    overhead_s: float | None = None
    prefetch_s: float | None = None
    fused_with: list[int] | None = None
    """The other trials (batch indices) this one trained stacked with (horizontal fusion); None:
    it trained alone."""


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
    result: TrialReport | None = None
    """The executor's report for the trial (steps, best metric, compute/copy seconds, ...)."""
    compute_s: float | None = None
    copy_s: float | None = None
    stop_reason: StopReason | None = None
    """Why the trial stopped, as the executor reports it (None while it runs or if it did not say)."""
    repeats_skipped: list[int] | None = None
    """A sampler's trials: the earlier trials whose points the sampler asked again first for this
    trial; those asks were not run (core/search.py)."""
    fused_with: list[int] | None = None
    """The indices of the other trials of the batch this one trained with as one stacked model
    (horizontal fusion, docs/selection.md); None: it trained alone (or has not ended)."""
    started_at: datetime | None = None
    """When its job's current attempt started (None before it ran)."""
    finished_at: datetime | None = None
    """When its job ended (None while it runs): the order of the batch's best-so-far curve."""


class SpaceRange(PresentOnly):
    """A range dimension of a search space, as submitted (jobrules/space.py checked it): `low` and
    `high`, and optionally `log` (log-spaced), `int` (whole numbers) and `num` (grid points)."""

    model_config = ConfigDict(extra="allow")

    low: int | float
    high: int | float
    log: Any = None
    """Truthy: sample (and chart) on a log scale."""
    num: int | None = None


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
    space: dict[str, SpaceRange | list[Any]]
    """Dotted JobSpec path -> a range, or a list of the values to choose from."""
    request: StoredSelectionCreate
    """The submitted request, as stored."""
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


# ---- Server-Sent Events -----------------------------------------------------------------------
# A stream's frames are `event: <name>` with `data: <JSON>`; each *StreamEvents model below maps
# every event name the stream sends to its data's schema (documentation for the OpenAPI schema and
# the dashboard's generated types: the streams write these dicts themselves).


class MetricPoint(BaseModel):
    step: int
    name: str
    value: float
    time: float


class StatusFrame(BaseModel):
    status: str
    error: str | None
    time: float


class LogFrame(BaseModel):
    message: str
    time: float
    rank: int | None
    """The trainer's own output names its rank and stream (stdout, stderr); status lines do not."""
    stream: str | None


class EventFrame(BaseModel):
    event: str
    data: Any
    time: float


class JobStreamEvents(BaseModel):
    """GET /api/jobs/{id}/stream: the job's metric points, status changes, log lines and other
    events; the id of each stored frame is the resume cursor (Last-Event-ID)."""

    metric: MetricPoint
    status: StatusFrame
    log: LogFrame
    event: EventFrame


class JobDeleted(BaseModel):
    job_id: int


class Resync(BaseModel):
    """Changes published while the broker was down are lost: reload."""


class JobsStreamEvents(BaseModel):
    """GET /api/events: every visible job's changes."""

    job: JobPublic
    deleted: JobDeleted
    resync: Resync


class TrialMetricPoint(MetricPoint):
    trial_id: int
    job_id: int


class SelectionStatus(BaseModel):
    status: str


class SelectionStreamEvents(BaseModel):
    """GET /api/selections/{id}/stream: every trial's state first, then metric points, trial
    changes and the batch's status."""

    metric: TrialMetricPoint
    trial: TrialPublic
    status: SelectionStatus


def sse_doc(events: type[BaseModel]) -> dict[int | str, dict[str, Any]]:
    """A stream route's `responses`: a text/event-stream whose events `events` lists by name."""
    return {
        200: {
            "description": f"Server-Sent Events; each event's data by its name: {events.__name__}",
            "model": events,
        }
    }
