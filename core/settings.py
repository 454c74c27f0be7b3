"""Settings of the API and the workers, from SHARDYARD_* environment variables."""

from __future__ import annotations

import functools
from pathlib import Path

from pydantic import SecretStr
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
    """A worker whose last heartbeat is older than this counts as gone."""
    heartbeat_s: float = 5.0
    worker_slots: int = 0
    """Ranks one job may run on this worker (reported in its heartbeat); 0: 4 per CPU core."""
    requeue_after_s: float = 600.0
    """The reconciler re-sends the message of a job queued longer than this (claims are
    idempotent, so a duplicate is harmless)."""
    reconcile_s: float = 60.0
    """How often each worker runs the reconciler (re-queue jobs of dead workers, re-send lost
    messages)."""

    @property
    def orphan_after_s(self) -> float:
        """Heartbeat silence after which a worker's running jobs are taken back (three windows,
        so a slow heartbeat alone never gets a job run twice)."""
        return 3 * self.worker_alive_s

    frontend_dist: Path = ROOT / "frontend" / "dist"
    sse_keepalive_s: float = 15.0
    cancel_grace_s: float = 30.0
    """After a cancel, the trainer has this long to stop at a step boundary before it is killed."""

    # ---- users, requests, quotas (api/auth.py, api/limits.py, api/admission.py) ----
    admin_token: SecretStr | None = None
    """At API start-up, user `admin_name` (an admin, created if missing) holds this token: the first
    admin of a new deployment, and the token `shardyard stack` prints. No default: unset, no one is
    created and `shardyard admin create-user` makes the first admin."""
    admin_name: str = "admin"
    trusted_hosts: list[str] = ["127.0.0.1", "localhost"]
    """Host headers the API answers (JSON list); others get 400. Add the public name in production."""
    max_body_bytes: int = 1_048_576
    """Largest request body (413 above)."""
    session_ttl_s: float = 12 * 3600
    """A dashboard sign-in lasts this long."""
    cookie_secure: bool = False
    """Mark the session cookies Secure (set it when the dashboard is served over HTTPS)."""
    quota_running_jobs: int = 4
    """Default per-user limits (a user row may override each): jobs running at once, their ranks
    and their GPUs. A job over the limit waits queued with the reason; one that could never fit is
    refused at submit."""
    quota_ranks: int = 64
    quota_gpus: int = 8

    @property
    def quota_defaults(self) -> dict[str, int]:
        return {"running_jobs": self.quota_running_jobs, "ranks": self.quota_ranks, "gpus": self.quota_gpus}


@functools.cache
def get_settings() -> Settings:
    return Settings()
