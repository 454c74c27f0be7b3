"""Settings of the API and the workers, from SHARDYARD_* environment variables."""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Literal

from pydantic import Field, SecretStr, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from core.egress import EgressAllow

ROOT = Path(__file__).resolve().parent.parent


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="SHARDYARD_", extra="ignore")

    database_url: str = f"sqlite:///{ROOT / '.shardyard' / 'shardyard.db'}"
    """SQLAlchemy URL: sqlite:///path (embedded default) or postgresql+psycopg2://user:pw@host/db."""
    broker_url: str = "redis://127.0.0.1:6379/0"
    """Redis URL used as the Celery broker and for the live metric channels."""
    broker_signing_key: SecretStr | None = None
    """The key (32+ random bytes, e.g. `openssl rand -hex 32`) the workers and the API sign their
    live messages with and the API verifies them by (core/broker.py): every process but the
    trainers gets it. Unset, live messages are only cues to read the database (slower streams,
    and no live output past a job's stored head)."""
    data_dir: Path = ROOT / ".shardyard"
    """This host's folder: job specs, trainer logs and the checkpoints a trainer writes (one
    folder per job), and the local copies of what comes from the store (storage_url)."""
    storage_url: str = ""
    """Where uploaded workspaces and checkpoints live for every host (core/storage.py): empty,
    the data dir itself (one machine, or a data dir every host mounts; nothing is copied);
    `file:///abs/path` another folder; `s3://bucket/prefix` an S3-compatible store (AWS S3, MinIO,
    Ceph) with credentials from AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY / AWS_DEFAULT_REGION."""
    storage_endpoint_url: str = ""
    """The S3 endpoint of a store that is not AWS (MinIO, Ceph's RGW: http://host:9000); empty:
    AWS."""
    storage_sync_s: float = 1.0
    """While a trainer runs, its worker uploads new checkpoints to the store at least this often
    (and at once when the trainer reports one)."""
    max_job_runtime_s: int = 7 * 24 * 3600
    """Longest a job may run; the broker's visibility timeout is set above it so a long job is
    never delivered twice."""
    worker_alive_s: float = 30.0
    """A worker whose last heartbeat is older than this counts as gone (health, placement). Until
    then the scheduler may place a job taken back from a dead worker on that worker again, so keep
    it at or below lease_s (a few heartbeat_s)."""
    heartbeat_s: float = 5.0
    log_head_lines: int = 2000
    """Lines of a job attempt's own output (prints, warnings, tracebacks) stored as they come."""
    log_tail_lines: int = 2000
    """Past `log_head_lines`, the last lines of the attempt kept and stored at its end (with a note
    of how many were dropped between)."""
    hw_sample_s: float = 5.0
    """Seconds between hardware samples of a job's ranks (CPU %, RSS; GPU utilisation, memory and
    power through NVML); 0 turns sampling off."""
    lease_s: float = 30.0
    """A running job's lease: its worker process renews it (with every batch of lines it applies,
    and at least every lease_s / 3); once it runs out by database time, anyone may take the job
    over. The time from a worker's death to its job running again is about
    max(lease_s, worker_alive_s) + reconcile_s."""
    worker_slots: int = 0
    """Ranks one job may run on this worker (reported in its heartbeat); 0: 4 per CPU core."""
    trainer_cores: int = Field(0, ge=0)
    """Cores one run may use, which it keeps its torch threads to (split between its processes on
    the host: a job's ranks, a selection batch's devices). 0: the worker's cores over its
    --concurrency, so the jobs it runs at once do not put two threads on a core (workers/cores.py).
    On a Slurm node (docs/slurm.md) the run's allocation is the share; this can only lower it."""
    trainer_nice: int = 0
    """The CPU priority (nice value, 0-19) each trainer takes at its start, for its session as a
    whole (/proc/self/autogroup) and its threads: where the API shares a machine with trainers
    that use every core, a high value keeps the service answering. Most kernels share the CPU
    between sessions before nice values count, and each trainer runs in a session of its own, so
    renicing a trainer's threads from outside does not do it (docs/deploy.md). 0: unchanged."""
    requeue_after_s: float = 600.0
    """The last resort for a lost order: the scheduler sends a reservation's task again when it was
    sent this long ago and nobody claimed it, whatever its worker reported (a duplicate is
    harmless: the claim is one conditional update, made where the job was reserved only)."""
    lost_order_s: float = 10.0
    """A worker that could have taken a task for this long (ready, connected to the broker, a pool
    process free and no other task held) while an order placed on it, already sent, stayed
    unclaimed takes that order as lost and asks the scheduler to send it again
    (workers/intake.py). A worker still starting asks nothing: it gets no duplicate."""
    reconcile_s: float = 10.0
    """How often each worker runs the reconciler (take back jobs whose lease ran out, settle
    batches)."""
    db_retry_s: float = 120.0
    """A worker retries a database write that fails (locked, unreachable) for this long before it
    gives the attempt up; the job's lease then runs out and it runs again from its checkpoint."""
    warm_trainer: bool = True
    """Single-process trainer runs start warm: sandboxed, from a spare trainer each worker pool
    process keeps imported in a sandbox of its own (workers/spare.py); unsandboxed, forked from a
    zygote that imported torch once (workers/warm.py). False: every run starts a fresh Python."""
    spare_ahead: Literal["auto", "always", "never"] = "auto"
    """When a pool process starts its next spare sandboxed trainer (workers/spare.py) after a run
    took the last one. auto: at once for a run whose compute is on a GPU (it holds GPUs, or asks
    for any device on a host with NVIDIA device nodes), since the spare's imports then use a core
    the run leaves idle; when the run has ended for a run on the CPU, whose threads use its share
    of the cores (workers/cores.py).
    always: at once for every run (a host whose runs leave cores idle). never: when the run has
    ended. Started at once, a job right after another on the same pool process starts warm."""
    scheduler_s: float = 1.0
    """The scheduler's tick: how often it frees ended reservations and places queued jobs (a
    submit also wakes the API's embedded scheduler at once)."""
    aging_s: float = 600.0
    """A queued job's effective priority grows by 1 for every aging_s it has waited, so a
    low-priority job is never passed over forever."""
    fair_share_window_s: float = 3600.0
    """Fair share counts each user's slot-seconds over this recent window (plus what runs now)."""
    preemption: bool = False
    """A higher-priority job that cannot fit asks lower-priority running jobs to checkpoint and
    go back to the queue."""
    gang_restarts: int = 3
    """How often a multi-node job restarts its gang from the last checkpoint after losing a node."""
    embedded_scheduler: bool = True
    """Run the scheduler in a child process of each API process (one is active at a time,
    by a database lock); off when `shardyard scheduler` runs it standalone."""
    shutdown_grace_s: float = 20.0
    """Warm shutdown (SIGTERM): running trainers are asked to stop and checkpoint, and killed
    after this long; their jobs go back to `queued`. Whoever stops a worker should wait this plus
    ~10 s before a hard kill."""

    workspace_max_mb: float = 100.0
    """Largest workspace upload (the archive as sent), in MiB."""
    workspace_max_unpacked_mb: float = 1024.0
    """Largest unpacked size of a workspace archive, in MiB (bounds zip bombs)."""

    @property
    def workspaces_dir(self) -> Path:
        """Workspace archives, content-addressed: <data_dir>/workspaces/<sha256>.<tar.gz|zip> (the
        store itself by default; this host's cache of it when storage_url names another)."""
        return self.data_dir / "workspaces"

    # ---- users' own Python requirements (workers/pyenv.py) ----
    pyenv_dir: Path | None = None
    """Where the workers keep the environments built from jobs' requirements (one folder per hash
    of the requirements and platform); empty: <data_dir>/envs. Each host keeps its own."""
    pyenv_cache_mb: float = 10240.0
    """Total size of the environment cache; past it the least recently used environments (that no
    job is building) are deleted."""
    pyenv_max_mb: float = 2048.0
    """Largest one environment may be; a bigger one fails its job with the sizes."""
    pyenv_build_timeout_s: float = 600.0
    """Longest an environment build may take (resolve and install); past it the job fails."""
    pyenv_index_url: str = ""
    """The package index the workers install from (uv's --default-index); empty: PyPI. For workers
    without internet, an internal mirror."""
    pyenv_find_links: str = ""
    """A local wheelhouse (folder or URL of wheel files) searched besides the index."""
    pyenv_no_index: bool = False
    """Install only from `pyenv_find_links` (no index at all): offline workers."""
    pyenv_allow_options: bool = False
    """Admin switch: accept pip options (--index-url, -e, ...) and URLs or local paths in
    requirements. Off: such a line is refused, naming it."""

    @property
    def sandbox_paths(self) -> list[Path]:
        return [Path(p) for p in self.sandbox_read_only.split(os.pathsep) if p]

    @property
    def pyenv_root(self) -> Path:
        return self.pyenv_dir or self.data_dir / "envs"

    # ---- the sandbox each attempt's trainer runs in (workers/sandbox.py, docs/security.md) ----
    sandbox: Literal["on", "off"] = "on"
    """on: every trainer runs in a bubblewrap sandbox, and a worker that cannot make one refuses
    jobs with users' code; off (an operator's choice, shown by /api/health and the dashboard):
    trainers run as the worker's children (still without the worker's credentials)."""
    sandbox_bwrap: str = ""
    """The bubblewrap executable; empty: `bwrap` on PATH."""
    sandbox_read_only: str = ""
    """Host folders (os.pathsep-separated, e.g. shared datasets) every sandbox sees read-only,
    at the same path: a spec's absolute data paths must lie in one of them."""
    sandbox_nofile: int = 8192
    """Open files one trainer process may hold (RLIMIT_NOFILE)."""
    sandbox_nproc: int = 2048
    """Processes and threads the sandbox may hold at once (RLIMIT_NPROC of its own user)."""

    frontend_dist: Path = ROOT / "frontend" / "dist"
    sse_keepalive_s: float = 15.0
    sse_max_per_client: int = 20
    """Open Server-Sent Event streams one user may hold; one more is
    answered 429."""
    stall_log_s: float = 2.0
    """A request still unanswered after this long makes the API log every one of its threads' stacks
    once (api/stalls.py: where it waits, the database's lock or the pool); 0 turns it off."""
    checkpoint_keep: int = 3
    """The trainer keeps this many newest checkpoints per job (0 keeps all); it reads the same
    SHARDYARD_CHECKPOINT_KEEP variable, which the worker's environment passes on."""
    job_retention_days: float = 0.0
    """Finished jobs (with their folders, metrics and events) older than this are deleted by the
    API's periodic cleanup, and so are ended selection batches with their trials; 0 keeps them
    forever. What bounds the database: docs/benchmarks.md "At scale" gives its bytes per million
    metric points."""
    retention_check_s: float = 3600.0
    """How often the API looks for finished jobs past their retention."""
    cancel_grace_s: float = 30.0
    """After a cancel, the trainer has this long to stop at a step boundary before it is killed."""

    # ---- users, requests, quotas (api/auth.py, api/limits.py, api/admission.py) ----
    admin_token: SecretStr | None = None
    """At API start-up, user `admin_name` (an admin, created if missing) holds this token: the first
    admin of a new deployment, and the token `shardyard stack` prints. No default: unset, no one is
    created and `shardyard admin create-user` makes the first admin."""
    admin_token_file: Path | None = None
    """A file holding the admin token (a compose secret: /run/secrets/admin_token), read at API
    start-up in place of SHARDYARD_ADMIN_TOKEN, so the token is in no process's environment
    (/proc/<pid>/environ keeps a variable for the process's whole life). `shardyard stack` hands its
    API the token this way, in a 0600 file it deletes once the API is up."""
    admin_name: str = "admin"
    trusted_hosts: list[str] = ["127.0.0.1", "localhost"]
    """Host headers the API answers (JSON list; `*.example.com` for any name below it); others get
    400 naming the refused host and this setting. Add the public name in production. `shardyard
    stack` adds the machine's own host name (unless this is set), so its dashboard opens by name."""
    max_body_bytes: int = 1_048_576
    """Largest request body (413 above)."""
    session_ttl_s: float = 12 * 3600
    """A dashboard sign-in lasts at most this long (its absolute expiry)."""
    session_idle_s: float = 2 * 3600
    """A dashboard session ends after this long without a request or an open stream."""
    stream_auth_check_s: float = 3.0
    """Every open event stream asks again this often whether its token or session is still live,
    and ends with an `error` frame once it is not (revoked, expired, idle)."""
    cookie_secure: bool = False
    """Mark the session cookies Secure (set it when the dashboard is served over HTTPS)."""
    auth_fail_limit: int = 10
    """Failed token checks (an unknown or revoked Bearer token, sign-in or confirm_token) one client
    address may make within `auth_fail_window_s`; past it, each further failure is answered 429
    with Retry-After. A live token is never refused by it. 0 turns the limit off."""
    auth_fail_window_s: float = 60.0
    """The sliding window `auth_fail_limit` counts failures in."""
    quota_running_jobs: int = 4
    """Default per-user limits (a user row may override each): jobs running at once, their ranks
    and their GPUs. A job over the limit waits queued with the reason; one that could never fit is
    refused at submit."""
    quota_ranks: int = 64
    quota_gpus: int = 8
    selection_max_trials: int = 1000
    """Most trials one selection batch may hold in all: a submit (a grid's points, `trials`) or an
    add of trials that would pass it is refused with 422 naming the numbers. Each trial is checked
    and stored like a job, so a thousand more cost the API seconds, and the batch's page, stream
    and leaderboard carry every one. 0: no limit."""

    # ---- jobs wider than one node (workers/gang.py) ----
    node_addr: str = ""
    """The address other nodes reach this worker at (torchrun's --local-addr, and node 0's
    rendezvous endpoint host); empty: the address the hostname resolves to."""
    gang_join_s: float = 120.0
    """How long a node of a multi-node job waits for node 0's rendezvous endpoint, and torchrun
    waits for every node to join, before the node gives up with the reason."""

    # ---- webhooks (core/webhooks.py) and metrics (api/metrics.py) ----
    webhook_timeout_s: float = 10.0
    """The deadline of one delivery as a whole: connecting (through the proxy, if one is set),
    sending, and the receiver's status line and headers must all fit in it. A receiver that is
    slower, or drips its answer a byte at a time, fails the attempt at the deadline."""
    webhook_attempts: int = 8
    """Attempts per delivery before it is given up (`failed` in the delivery log)."""
    webhook_backoff_s: float = 5.0
    """The wait before the second attempt; it doubles after each failure (capped at an hour)."""
    webhook_concurrency: int = 8
    """Deliveries in flight at once per deliverer: a receiver that hangs holds one of them for
    webhook_timeout_s, never the others."""
    webhook_poll_s: float = 1.0
    """How often the deliverer looks for due deliveries."""
    webhook_allow: list[str] = []
    """Operator allow-list (JSON list) of networks in CIDR form (`"10.20.0.0/16"`, `"127.0.0.1/32"`,
    `"fd00::/8"`) and host names (`"hooks.internal"`) webhooks may reach although they are not
    public. Every other loopback, private, link-local, unspecified, multicast or reserved address,
    in any spelling (IPv4-mapped, IPv4-compatible, NAT64, 6to4, Teredo), is refused: server-side
    request forgery into the service's own network. Tests and single-machine setups list
    127.0.0.1/32 to reach receivers on loopback."""
    webhook_proxy: str = ""
    """`http://[user:password@]host:port` of an HTTP CONNECT proxy every delivery goes through
    (the proxy itself is the operator's and is not checked); the target's address is still
    checked here and the tunnel asked for by that address, never by name. Empty: direct. A value
    that does not parse fails every delivery with the reason (never sending direct instead); it is
    checked by the deliverer, not here, where the error would print the URL, password and all."""
    webhook_max_per_user: int = 20
    """Most webhooks one user may have; one more is refused (409) until one is deleted. 0: no limit."""

    @field_validator("trainer_nice")
    @classmethod
    def _trainer_nice_in_range(cls, value: int) -> int:
        if not 0 <= value <= 19:
            raise ValueError(f"trainer_nice must be 0-19 (a nice value a process may take), not {value}")
        return value

    @field_validator("webhook_allow")
    @classmethod
    def _webhook_allow_parses(cls, value: list[str]) -> list[str]:
        # a typo refuses to start rather than silently allowing nothing (or too much)
        EgressAllow.parse(value)
        return value

    @property
    def quota_defaults(self) -> dict[str, int]:
        return {"running_jobs": self.quota_running_jobs, "ranks": self.quota_ranks, "gpus": self.quota_gpus}


@functools.cache
def get_settings() -> Settings:
    return Settings()
