"""Settings of the API and the workers, from SHARDYARD_* environment variables."""

from __future__ import annotations

import functools
from pathlib import Path

from pydantic_settings import BaseSettings, SettingsConfigDict

ROOT = Path(__file__).resolve().parent.parent


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="SHARDYARD_", extra="ignore")

    database_url: str = f"sqlite:///{ROOT / '.shardyard' / 'shardyard.db'}"
    """SQLAlchemy URL: sqlite:///path (embedded default) or postgresql+psycopg2://user:pw@host/db."""
    broker_url: str = "redis://127.0.0.1:6379/0"
    """Redis URL used as the Celery broker and for the live metric channels."""
    data_dir: Path = ROOT / ".shardyard"
    """Checkpoints, job specs and trainer logs live under here (one folder per job)."""
    max_job_runtime_s: int = 7 * 24 * 3600
    """Longest a job may run; the broker's visibility timeout is set above it so a long job is
    never delivered twice."""
    worker_alive_s: float = 30.0
    """A worker whose last heartbeat is older than this counts as gone (health, placement)."""
    heartbeat_s: float = 5.0
    lease_s: float = 30.0
    """A running job's lease: its worker process renews it (with every batch of lines it applies,
    and at least every lease_s / 3); once it runs out by database time, anyone may take the job
    over. The time from a worker's death to its job running again is about lease_s + reconcile_s."""
    requeue_after_s: float = 600.0
    """The reconciler re-sends the message of a job queued longer than this (claims are
    idempotent, so a duplicate is harmless)."""
    reconcile_s: float = 10.0
    """How often each worker runs the reconciler (take back jobs whose lease ran out, re-send lost
    messages, settle batches)."""
    db_retry_s: float = 120.0
    """A worker retries a database write that fails (locked, unreachable) for this long before it
    gives the attempt up; the job's lease then runs out and it runs again from its checkpoint."""
    shutdown_grace_s: float = 20.0
    """Warm shutdown (SIGTERM): running trainers are asked to stop and checkpoint, and killed
    after this long; their jobs go back to `queued`. Whoever stops a worker should wait this plus
    ~10 s before a hard kill."""

    frontend_dist: Path = ROOT / "frontend" / "dist"
    sse_keepalive_s: float = 15.0
    sse_max_per_client: int = 20
    """Open Server-Sent Event streams one client (user, else address) may hold; one more is
    answered 429."""
    checkpoint_keep: int = 3
    """The trainer keeps this many newest checkpoints per job (0 keeps all); it reads the same
    SHARDYARD_CHECKPOINT_KEEP variable, which the worker's environment passes on."""
    job_retention_days: float = 0.0
    """Finished jobs (with their folders, metrics and events) older than this are deleted by the
    API's periodic cleanup; 0 keeps them forever."""
    retention_check_s: float = 3600.0
    """How often the API looks for finished jobs past their retention."""
    cancel_grace_s: float = 30.0
    """After a cancel, the trainer has this long to stop at a step boundary before it is killed."""


@functools.cache
def get_settings() -> Settings:
    return Settings()
