"""Tables. The database is the source of truth for every job's state; Redis only carries messages."""

from __future__ import annotations

import enum
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    String,
    Text,
    TypeDecorator,
    UniqueConstraint,
    select,
    text,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, column_property, mapped_column, relationship

# SQLite only autoincrements INTEGER PRIMARY KEY; Postgres gets a BIGINT identity for metric rows.
BigId = BigInteger().with_variant(Integer(), "sqlite")


def utcnow() -> datetime:
    return datetime.now(UTC)


ERROR_MAX_CHARS = 8192
"""The most characters a job's or a selection batch's stored `error` holds (cap_error)."""


def cap_error(error: str | None, limit: int = ERROR_MAX_CHARS) -> str | None:
    """`error` cut to at most `limit` characters: its head and its tail (where a build log or a
    traceback says what went wrong) with a marker naming how much was cut between them. A
    requirements.txt of thousands of refused lines otherwise stores megabytes that every page of
    the job listing carries."""
    if error is None or len(error) <= limit:
        return error
    marker = f"\n[... {len(error)} characters in all; {{}} cut here ...]\n"
    keep = max(limit - len(marker.format(len(error))), 0)
    head = keep // 2
    tail = keep - head
    return error[:head] + marker.format(len(error) - keep) + (error[-tail:] if tail else "")


class ErrorText(TypeDecorator[str]):
    """Text cut by cap_error on every write: an ORM attribute, an UPDATE's values or an INSERT."""

    impl = Text
    cache_ok = True

    def process_bind_param(self, value: str | None, dialect: Any) -> str | None:
        return cap_error(value)


class Base(DeclarativeBase):
    type_annotation_map = {dict[str, Any]: JSON, datetime: DateTime(timezone=True)}


class JobStatus(enum.StrEnum):
    queued = "queued"
    running = "running"
    succeeded = "succeeded"
    failed = "failed"
    cancelled = "cancelled"


TERMINAL = frozenset({JobStatus.succeeded, JobStatus.failed, JobStatus.cancelled})


class User(Base):
    """Someone who may call the API. Quota columns left null take the service-wide default."""

    __tablename__ = "users"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(String(64), unique=True)
    is_admin: Mapped[bool] = mapped_column(Boolean, default=False)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    max_running_jobs: Mapped[int | None] = mapped_column(Integer, default=None)
    max_ranks: Mapped[int | None] = mapped_column(Integer, default=None)
    max_gpus: Mapped[int | None] = mapped_column(Integer, default=None)


class ApiToken(Base):
    """A bearer token (`api`, until revoked) or a dashboard cookie session (`session`, until it
    expires, is ended or its token is revoked). Only the SHA-256 of the secret is stored; the
    secret is shown once."""

    __tablename__ = "api_tokens"
    __table_args__ = (UniqueConstraint("token_hash", name="uq_api_tokens_token_hash"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    user_id: Mapped[int] = mapped_column(ForeignKey("users.id", ondelete="CASCADE"), index=True)
    kind: Mapped[str] = mapped_column(String(16), default="api")
    label: Mapped[str] = mapped_column(String(64), default="")
    token_hash: Mapped[str] = mapped_column(String(64))
    prefix: Mapped[str] = mapped_column(String(16))
    """The secret's first characters, so a user can tell tokens apart in a list."""
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    expires_at: Mapped[datetime | None] = mapped_column(default=None)
    revoked_at: Mapped[datetime | None] = mapped_column(default=None)
    parent_id: Mapped[int | None] = mapped_column(
        ForeignKey("api_tokens.id", ondelete="CASCADE"), index=True, default=None
    )
    """The token this one was made with (a session's sign-in token, a token minted by another):
    revoking a token revokes everything made from it, so one revocation cuts a leak off."""
    last_used_at: Mapped[datetime | None] = mapped_column(default=None)
    """A session's last request (written at most every few minutes): its idle expiry."""
    user: Mapped[User] = relationship(lazy="joined")


QUEUED_SQLITE = "status = 'queued' AND kind = 'job' AND cancel_requested IS 0"
QUEUED_POSTGRES = "status = 'queued' AND kind = 'job' AND cancel_requested IS false"
"""The rows ix_jobs_queued holds: the queue the scheduler reads (db/scheduling.py _QUEUED_WHERE)."""


class Job(Base):
    __tablename__ = "jobs"
    __table_args__ = (
        Index("ix_jobs_owner_id_id", "owner_id", "id"),
        # the listing's counts and name search read this narrow index, not the rows (migration 0015)
        Index("ix_jobs_listing", "status", "kind", "owner_id", "name"),
        # PostgreSQL: a search by name reads trigrams, not every name (migration 0017); on SQLite
        # a plain index on name, so both databases have one schema
        Index("ix_jobs_name_trgm", "name", postgresql_using="gin", postgresql_ops={"name": "gin_trgm_ops"}),
        # the scheduler's reads each tick: the queue's versions, and recent usage (migration 0018)
        Index(
            "ix_jobs_queued",
            "id",
            "enqueued_at",
            "attempts",
            sqlite_where=text(QUEUED_SQLITE),
            postgresql_where=text(QUEUED_POSTGRES),
        ),
        Index("ix_jobs_started_at", "started_at"),
        Index("ix_jobs_finished_at", "finished_at"),
        # room on each page: the scheduler's wait-reason rewrites stay HOT updates (migration 0010)
        {"postgresql_with": {"fillfactor": 70}},
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(String(200))
    kind: Mapped[str] = mapped_column(String(20), default="job")
    """`job` for a submitted job, `trial` for one trial of a selection batch."""
    spec: Mapped[dict[str, Any]] = mapped_column(JSON)
    status: Mapped[str] = mapped_column(String(20), default=JobStatus.queued, index=True)
    priority: Mapped[int] = mapped_column(Integer, default=0)
    queue: Mapped[str] = mapped_column(String(40), default="cpu")
    world_size: Mapped[int] = mapped_column(Integer, default=1)
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    step: Mapped[int] = mapped_column(Integer, default=0)
    """Last training step reported (progress)."""
    steps: Mapped[int] = mapped_column(Integer, default=0)
    last_loss: Mapped[float | None] = mapped_column(Float, default=None)
    """Latest training loss reported (the jobs table shows it live)."""
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    enqueued_at: Mapped[datetime | None] = mapped_column(default=None)
    started_at: Mapped[datetime | None] = mapped_column(default=None)
    finished_at: Mapped[datetime | None] = mapped_column(default=None)
    worker: Mapped[str | None] = mapped_column(String(200), default=None)
    """Name of the worker that runs (or last ran) the job, for people; ownership is `owner`."""
    owner: Mapped[str | None] = mapped_column(String(120), default=None)
    """Unique id of the worker process start that holds the lease (None when nobody does). Every
    write of an attempt is fenced by (owner, attempts): a stale attempt changes nothing."""
    lease_until: Mapped[datetime | None] = mapped_column(default=None)
    """Database time at which the lease runs out unless renewed; after it the job is reclaimable."""
    applied_seq: Mapped[int] = mapped_column(Integer, default=-1)
    """Highest protocol sequence number of the current attempt applied (a retried batch that
    had in fact been committed changes nothing)."""
    applied_step: Mapped[int] = mapped_column(Integer, default=0)
    """Every line up to this step is in the database (a `checkpoint` event or the result at that
    step was applied). A new attempt resumes from no later checkpoint, so no metric step is lost."""
    run_seconds: Mapped[float] = mapped_column(Float, default=0.0)
    """Wall time the job's attempts have run, written with each relay batch of the attempt (a
    killed attempt loses at most the time since its last batch): max_runtime_s counts it all."""
    restarts: Mapped[int] = mapped_column(Integer, default=0)
    """Attempts that failed for the infrastructure (a rank killed by a signal, a lost worker) and
    went back to the queue; the spec's max_restarts bounds it (db/jobs.py restart_job)."""
    error: Mapped[str | None] = mapped_column(ErrorText, default=None)
    result: Mapped[dict[str, Any] | None] = mapped_column(JSON, default=None)
    divergence: Mapped[str | None] = mapped_column(Text, default=None)
    """Why the run counts as diverged (its final smoothed loss far above its first; the rule is
    jobrules/divergence.py's), written at its end by its worker; None when it did not."""
    cancel_requested: Mapped[bool] = mapped_column(Boolean, default=False)
    selection_id: Mapped[int | None] = mapped_column(
        ForeignKey("selections.id", ondelete="CASCADE"), default=None, index=True
    )
    owner_id: Mapped[int | None] = mapped_column(ForeignKey("users.id", ondelete="SET NULL"), default=None)
    """Who submitted it (a trial's job: the selection's owner); null for jobs from before users."""
    wait_reason: Mapped[str | None] = mapped_column(Text, default=None)
    """Why a queued job is not running yet (the scheduler's reason: no worker big enough, quota,
    behind a higher-priority job, no live worker); cleared when it is placed."""
    nnodes: Mapped[int] = mapped_column(Integer, default=1)
    """Workers (nodes) the job is placed on: 1, or a gang of several with equal ranks each."""
    preempt_requested: Mapped[bool] = mapped_column(Boolean, default=False)
    """The scheduler asks the running attempt to checkpoint and give the job back to the queue
    (a higher-priority job needs its slots); cleared when the job is queued again."""
    user: Mapped[User | None] = relationship(lazy="joined")
    """The submitting user (`owner_id`); `owner` on a job is the worker process holding its lease."""
    trial: Mapped[Trial | None] = relationship(
        primaryjoin="Trial.job_id == Job.id", viewonly=True, uselist=False, lazy="select"
    )
    """A trial's job: its trial row (read when asked for: only a `trial` job has one)."""


class Reservation(Base):
    """Slots the scheduler set aside for one node of a job's attempt on one worker, or for one
    group of a selection batch's trials (`trial_ids`). All nodes of a job are reserved in one
    transaction; the rows are deleted when the attempt (or the group) ends, is given back, or its
    lease (or a node's) runs out."""

    __tablename__ = "reservations"
    __table_args__ = (UniqueConstraint("job_id", "node_rank", name="uq_reservations_job_node"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    job_id: Mapped[int] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), index=True)
    worker: Mapped[str] = mapped_column(String(200), index=True)
    """The WorkerBeat.name the node's task goes to (its direct queue, core/broker.py node_queue)."""
    node_rank: Mapped[int] = mapped_column(Integer, default=0)
    nnodes: Mapped[int] = mapped_column(Integer, default=1)
    slots: Mapped[int] = mapped_column(Integer, default=1)
    """Ranks of the job on this node."""
    gpus: Mapped[int] = mapped_column(Integer, default=0)
    ram_bytes: Mapped[int] = mapped_column(BigInteger, default=0)
    attempt: Mapped[int] = mapped_column(Integer, default=0)
    """The job's attempts counter when reserved; the task's claim makes it attempt + 1."""
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    sent_at: Mapped[datetime | None] = mapped_column(default=None)
    """When the node's task was last sent (the scheduler re-sends an unclaimed one later)."""
    claimed_at: Mapped[datetime | None] = mapped_column(default=None)
    owner: Mapped[str | None] = mapped_column(String(120), default=None)
    """The worker process id (workers/execute.py owner_id()) of the node's task, set at its claim."""
    lease_until: Mapped[datetime | None] = mapped_column(default=None)
    rdzv_endpoint: Mapped[str | None] = mapped_column(String(200), default=None)
    """host:port of node 0's rendezvous, written by node 0 for the others (multi-node jobs)."""
    trial_ids: Mapped[list[int] | None] = mapped_column(JSON(none_as_null=True), default=None)
    """A selection group's reservation: the ids of the trials its task runs (`job_id` is the
    first trial's job, node 0 of 1). None for a job's node."""


class SchedulerLock(Base):
    """One row per lock name: whoever holds an unexpired lease is the active scheduler."""

    __tablename__ = "scheduler_locks"

    name: Mapped[str] = mapped_column(String(40), primary_key=True)
    holder: Mapped[str | None] = mapped_column(String(120), default=None)
    lease_until: Mapped[datetime | None] = mapped_column(default=None)


class MetricPoint(Base):
    __tablename__ = "metric_points"
    # one row per (job, name, step): a re-run from a checkpoint overwrites, never duplicates
    __table_args__ = (Index("ix_metric_points_job_name_step", "job_id", "name", "step", unique=True),)

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    job_id: Mapped[int] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), index=True)
    step: Mapped[int] = mapped_column(Integer)
    name: Mapped[str] = mapped_column(String(64))
    value: Mapped[float] = mapped_column(Float)
    time: Mapped[float] = mapped_column(Float)
    """Unix seconds when the trainer produced the point."""


class MetricSummary(Base):
    """A long series kept downsampled beside its points (api/series.py): a chart's first read of a
    job with a million points reads this and the points stored after `upto_id`, not every point.
    Written by the API after a full read; stands for the job's attempt `attempt` only."""

    __tablename__ = "metric_summaries"

    job_id: Mapped[int] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), primary_key=True)
    name: Mapped[str] = mapped_column(String(64), primary_key=True)
    attempt: Mapped[int] = mapped_column(Integer)
    """The job's attempts counter when written: a later attempt rewrites points in place."""
    upto_id: Mapped[int] = mapped_column(BigInteger)
    """The job's newest metric point id it covers (of every series)."""
    points: Mapped[int] = mapped_column(Integer)
    """How many points of the series it stands for."""
    steps: Mapped[bytes] = mapped_column(LargeBinary)
    """int64 steps, little-endian."""
    values: Mapped[bytes] = mapped_column(LargeBinary)
    """float64 values, little-endian, one per step."""


class JobEvent(Base):
    """Status changes, log lines and structured trainer events (checkpoint, timeline, ...)."""

    __tablename__ = "job_events"
    __table_args__ = (Index("ix_job_events_job_id_id", "job_id", "id"),)

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    job_id: Mapped[int] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"))
    time: Mapped[float] = mapped_column(Float)
    kind: Mapped[str] = mapped_column(String(16))
    """`status`, `log` or `event`."""
    message: Mapped[str] = mapped_column(Text, default="")
    data: Mapped[dict[str, Any] | None] = mapped_column(JSON, default=None)


class WorkerBeat(Base):
    __tablename__ = "workers"

    name: Mapped[str] = mapped_column(String(200), primary_key=True)
    hostname: Mapped[str] = mapped_column(String(200))
    queues: Mapped[dict[str, Any]] = mapped_column(JSON)
    devices: Mapped[dict[str, Any]] = mapped_column(JSON)
    started_at: Mapped[datetime] = mapped_column(default=utcnow)
    last_seen: Mapped[datetime] = mapped_column(default=utcnow)


class Selection(Base):
    """A model-selection batch: many trials of one base spec."""

    __tablename__ = "selections"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(String(200))
    request: Mapped[dict[str, Any]] = mapped_column(JSON)
    status: Mapped[str] = mapped_column(String(20), default=JobStatus.queued, index=True)
    metric: Mapped[str] = mapped_column(String(64), default="val_loss")
    mode: Mapped[str] = mapped_column(String(8), default="min")
    scheduler: Mapped[str] = mapped_column(String(32), default="shard-lrtf")
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    started_at: Mapped[datetime | None] = mapped_column(default=None)
    finished_at: Mapped[datetime | None] = mapped_column(default=None)
    error: Mapped[str | None] = mapped_column(ErrorText, default=None)
    cancel_requested: Mapped[bool] = mapped_column(Boolean, default=False)
    owner_id: Mapped[int | None] = mapped_column(
        ForeignKey("users.id", ondelete="SET NULL"), default=None, index=True
    )
    user: Mapped[User | None] = relationship(lazy="joined")
    trials: Mapped[list[Trial]] = relationship(
        back_populates="selection", order_by="Trial.index", cascade="all, delete-orphan"
    )


class Trial(Base):
    __tablename__ = "trials"
    # a batch grown by two workers at once must not get the same trial twice
    __table_args__ = (Index("ux_trials_selection_index", "selection_id", "index", unique=True),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    selection_id: Mapped[int] = mapped_column(ForeignKey("selections.id", ondelete="CASCADE"), index=True)
    index: Mapped[int] = mapped_column(Integer)
    params: Mapped[dict[str, Any]] = mapped_column(JSON)
    job_id: Mapped[int] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"))
    status: Mapped[str] = mapped_column(String(20), default=JobStatus.queued)
    steps_done: Mapped[int] = mapped_column(Integer, default=0)
    steps_total: Mapped[int] = mapped_column(Integer, default=0)
    last_metric: Mapped[float | None] = mapped_column(Float, default=None)
    best_metric: Mapped[float | None] = mapped_column(Float, default=None)
    stopped_early: Mapped[bool] = mapped_column(Boolean, default=False)
    stop_requested: Mapped[bool] = mapped_column(Boolean, default=False)
    warm_start_from: Mapped[int | None] = mapped_column(Integer, default=None)
    result: Mapped[dict[str, Any] | None] = mapped_column(JSON, default=None)
    """What the executor reported for the trial (compute and copy seconds, best metric, steps,
    stop reason ...), stored when it arrives, whatever the order of the trial's other lines."""
    # its job's times, read in the trials' own SELECT (a subquery by primary key per row): a
    # batch's 1,000 trials cost no query each
    started_at: Mapped[datetime | None] = column_property(
        select(Job.started_at).where(Job.id == job_id).correlate_except(Job).scalar_subquery()
    )
    """When its job's current attempt started (a group's trials share their claim's time)."""
    finished_at: Mapped[datetime | None] = column_property(
        select(Job.finished_at).where(Job.id == job_id).correlate_except(Job).scalar_subquery()
    )
    """When its job ended (None while it runs): the order of a batch's best-so-far curve."""
    selection: Mapped[Selection] = relationship(back_populates="trials")


class Workspace(Base):
    """An uploaded workspace archive (user code and small data), stored content-addressed under
    the data dir (core/settings.py workspaces_dir) by its sha256."""

    __tablename__ = "workspaces"
    __table_args__ = (UniqueConstraint("owner_id", "digest", name="uq_workspaces_owner_digest"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    digest: Mapped[str] = mapped_column(String(64))
    """sha256 of the archive bytes, hex (one stored file per digest, one row per owner)."""
    size: Mapped[int] = mapped_column(BigInteger)
    """Archive bytes as uploaded."""
    name: Mapped[str] = mapped_column(String(200))
    format: Mapped[str] = mapped_column(String(10))
    """`tar.gz` or `zip`."""
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    owner_id: Mapped[int | None] = mapped_column(
        ForeignKey("users.id", ondelete="SET NULL", name="fk_workspaces_owner_id_users"),
        default=None,
        index=True,
    )
    """The uploading user."""


class Webhook(Base):
    """A user's endpoint told when their jobs and batches end. The secret signs each body; it is
    kept in the clear because signing needs it (unlike a token, whose hash suffices)."""

    __tablename__ = "webhooks"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    user_id: Mapped[int] = mapped_column(ForeignKey("users.id", ondelete="CASCADE"), index=True)
    url: Mapped[str] = mapped_column(String(2000))
    events: Mapped[str] = mapped_column(String(16), default="all")
    """`all` (every end: succeeded, failed, cancelled) or `failures` (failed only)."""
    secret: Mapped[str] = mapped_column(String(100))
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    user: Mapped[User] = relationship(lazy="joined")


class WebhookDelivery(Base):
    """The outbox: one row per (webhook, ended job or batch), written by a database trigger in
    the same transaction that ends the job (the webhooks migration, 0013), so no end is lost whichever code
    path ended it. The deliverer (core/webhooks.py) claims due rows with a lease."""

    __tablename__ = "webhook_deliveries"
    __table_args__ = (Index("ix_webhook_deliveries_due", "state", "next_at"),)

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    webhook_id: Mapped[int] = mapped_column(ForeignKey("webhooks.id", ondelete="CASCADE"), index=True)
    event: Mapped[str] = mapped_column(String(32))
    """`job.ended` or `selection.ended`."""
    object_id: Mapped[int] = mapped_column(Integer)
    status: Mapped[str] = mapped_column(String(20))
    """The job's or batch's terminal status when it ended."""
    state: Mapped[str] = mapped_column(String(12), default="pending")
    """`pending` (due at next_at), `delivered`, or `failed` (gave up after the last retry)."""
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    body: Mapped[str | None] = mapped_column(Text, default=None)
    """The JSON sent, fixed at the first attempt so every retry carries the same bytes."""
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    next_at: Mapped[datetime] = mapped_column(default=utcnow)
    lease_until: Mapped[datetime | None] = mapped_column(default=None)
    delivered_at: Mapped[datetime | None] = mapped_column(default=None)


class WebhookAttempt(Base):
    """One POST of a delivery: the delivery log."""

    __tablename__ = "webhook_attempts"

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    delivery_id: Mapped[int] = mapped_column(
        BigId, ForeignKey("webhook_deliveries.id", ondelete="CASCADE"), index=True
    )
    at: Mapped[datetime] = mapped_column(default=utcnow)
    status_code: Mapped[int | None] = mapped_column(Integer, default=None)
    error: Mapped[str | None] = mapped_column(Text, default=None)
    seconds: Mapped[float] = mapped_column(Float, default=0.0)
