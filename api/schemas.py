"""Response models, and the request models re-exported from jobrules/spec.py (their one
definition, which `python -m trainer` validates with too)."""

from __future__ import annotations

from datetime import datetime
from typing import Any, Literal

from pydantic import BaseModel

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

# env.pip may hold pip options only where the admin allows them
jobrules.spec.pip_options_allowed = lambda: get_settings().pyenv_allow_options


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
    repeats_skipped: list[int] | None = None
    """A sampler's trials: the earlier trials whose points the sampler asked again first for this
    trial; those asks were not run (core/search.py)."""


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
