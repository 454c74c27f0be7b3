"""Slurm pools: their settings, the names of their nodes as the scheduler sees them, and what is said
to Slurm (the sbatch command of a placed job) and read back from it (squeue's lines).

A Slurm pool is a launcher (docs/slurm.md): its submitter (workers/slurm_pool.py) writes a
heartbeat for each node the pool may use, named `slurm:<pool>:<i>`, so the scheduler reserves a
pool's nodes as it reserves workers' slots; it then submits one Slurm job per placed job, whose
node agents (workers/slurm_agent.py, one per node, started by srun) run the attempt. This module
is plain values and strings: core/ runs no Slurm command.
"""

from __future__ import annotations

import math
import re
import shlex
import sys
from dataclasses import dataclass

from pydantic import BaseModel, Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from core.settings import ROOT

POOL_PREFIX = "slurm:"
"""Worker names of a Slurm pool's nodes start with it: `slurm:<pool>:<i>`."""


class SlurmPool(BaseModel):
    """One Slurm pool: where its jobs go (partition, account, QOS) and what one of its nodes holds
    (the scheduler's view, which decides a job's node count; Slurm decides when and where)."""

    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,40}$")
    partition: str = ""
    """sbatch --partition; empty: the cluster's default partition."""
    account: str = ""
    """sbatch --account; empty: the user's default."""
    qos: str = ""
    """sbatch --qos; empty: the default."""
    nodes: int = Field(1, ge=1, le=4096)
    """Nodes the scheduler may place one job on (a gang of up to this many)."""
    slots_per_node: int = Field(4, ge=1)
    """Trainer ranks one node runs (sbatch --ntasks-per-node, one CPU each)."""
    gpus_per_node: int = Field(0, ge=0)
    """GPUs of one node (sbatch --gres=gpu:N for a job that asks for GPUs)."""
    mem_per_node_mb: int = Field(0, ge=0)
    """Host memory of one node in MiB: the most the scheduler places on one; 0: no limit of the
    pool's own (Slurm refuses what no node has)."""
    python: str = sys.executable
    """The Python on the nodes that has Shardyard installed (runs `-m workers.slurm_agent`)."""
    workdir: str = str(ROOT)
    """The folder on the nodes the agent starts in (the project, for `-m workers.slurm_agent`)."""
    time_limit_s: int = Field(3600, ge=60)
    """The Slurm time limit of a job whose spec sets no max_runtime_s."""
    signal_s: int = Field(60, ge=0)
    """Slurm sends SIGUSR1 this long before the time limit (`--signal=USR1@<s>`): the agent
    checkpoints and gives the job back to the queue. Slurm checks it about once a minute."""
    nice_base: int = Field(100, ge=0)
    """`--nice` is nice_base - the job's priority (-100..100), so a higher priority is a lower
    nice (a negative one only when Slurm lets the submitting user)."""
    job_prefix: str = Field("shardyard", pattern=r"^[A-Za-z0-9_.-]{1,40}$")
    """Slurm job names are `<job_prefix>-<job id>`: the submitter finds its jobs by it (one prefix
    per deployment that shares a cluster)."""
    sbatch_args: list[str] = []
    """More sbatch options, as they are (e.g. ["--constraint=a100"])."""

    def node_name(self, index: int) -> str:
        return f"{POOL_PREFIX}{self.name}:{index}"

    @property
    def node_names(self) -> list[str]:
        return [self.node_name(i) for i in range(self.nodes)]

    def queues(self) -> list[str]:
        return ["cpu", "gpu"] if self.gpus_per_node else ["cpu"]


class SlurmSettings(BaseSettings):
    """SHARDYARD_SLURM_* settings (docs/slurm.md)."""

    model_config = SettingsConfigDict(env_prefix="SHARDYARD_SLURM_", extra="ignore")

    pools: list[SlurmPool] = []
    """SHARDYARD_SLURM_POOLS: a JSON list of pools; empty: no Slurm pool."""
    poll_s: float = 1.0
    """How often the submitter reads squeue and the database."""
    sbatch_retry_s: float = 30.0
    """After sbatch refused a job (its words are the job's wait reason), the next try."""
    submit_tries: int = 3
    """The most Slurm jobs in a row submitted for one job that end before any node agent claims
    it; then the job fails with the reason (one that ran the job and gave it back does not count)."""


def is_pool_node(worker: str | None) -> bool:
    return bool(worker) and str(worker).startswith(POOL_PREFIX)


def pool_of(worker: str) -> str | None:
    """The pool a node name belongs to (None: not a pool's node)."""
    if not is_pool_node(worker):
        return None
    return worker[len(POOL_PREFIX) :].rsplit(":", 1)[0]


def job_name(pool: SlurmPool, job_id: int) -> str:
    return f"{pool.job_prefix}-{job_id}"


def job_of_name(pool: SlurmPool, name: str) -> int | None:
    m = re.fullmatch(re.escape(pool.job_prefix) + r"-(\d+)", name)
    return int(m.group(1)) if m else None


@dataclass(frozen=True, slots=True)
class Sizing:
    """One Slurm job's size: nodes, ranks and GPUs on each, host memory on each (MiB), minutes."""

    nodes: int
    tasks_per_node: int
    gpus_per_node: int
    mem_mb: int
    minutes: int


def sizing(
    pool: SlurmPool, *, nnodes: int, slots: int, gpus: int, ram_bytes: int, max_runtime_s: int | None
) -> Sizing:
    """From the reservation of one node (`slots`, `gpus`, `ram_bytes` each, `nnodes` of them) and
    the spec's max_runtime_s (None: the pool's time limit): the time limit covers the run, the
    signal's lead and a minute to settle (upload the last checkpoint, apply every line)."""
    run_s = max_runtime_s or pool.time_limit_s
    minutes = math.ceil(run_s / 60) + math.ceil(pool.signal_s / 60) + 1
    mem_mb = max(math.ceil(ram_bytes / 2**20), 256)
    return Sizing(nodes=nnodes, tasks_per_node=slots, gpus_per_node=gpus, mem_mb=mem_mb, minutes=minutes)


def nice(pool: SlurmPool, priority: int) -> int:
    return pool.nice_base - priority


def sbatch_command(
    pool: SlurmPool, *, job_id: int, size: Sizing, priority: int, output: str
) -> tuple[list[str], str]:
    """(sbatch's arguments, the batch script on its stdin). The script starts one node agent per
    node with srun; Slurm requeues the job after a node failure (`--requeue`) and warns the agents
    `signal_s` before the time limit (`--signal=USR1@<s>`)."""
    args = [
        "sbatch",
        "--parsable",
        f"--job-name={job_name(pool, job_id)}",
        f"--nodes={size.nodes}",
        f"--ntasks-per-node={size.tasks_per_node}",
        "--cpus-per-task=1",
        f"--mem={size.mem_mb}M",
        f"--time={size.minutes}",
        "--requeue",
        f"--nice={nice(pool, priority)}",
        f"--output={output}",
        f"--chdir={pool.workdir}",
    ]
    if pool.signal_s > 0:
        args.append(f"--signal=USR1@{pool.signal_s}")
    if size.gpus_per_node > 0:
        args.append(f"--gres=gpu:{size.gpus_per_node}")
    for flag, value in (("--partition", pool.partition), ("--account", pool.account), ("--qos", pool.qos)):
        if value:
            args.append(f"{flag}={value}")
    args += pool.sbatch_args
    agent = [pool.python, "-m", "workers.slurm_agent", "--job", str(job_id)]
    srun = [
        "srun",
        f"--nodes={size.nodes}",
        f"--ntasks={size.nodes}",
        "--ntasks-per-node=1",
        f"--cpus-per-task={size.tasks_per_node}",
        "--kill-on-bad-exit=0",
        *agent,
    ]
    script = "#!/bin/sh\n# a Shardyard job: one node agent per node (workers/slurm_agent.py)\n"
    script += "exec " + shlex.join(srun) + "\n"
    return args, script


@dataclass(frozen=True, slots=True)
class SlurmJob:
    """One line of squeue: the Slurm job of a Shardyard job."""

    slurm_id: int
    job_id: int
    state: str
    reason: str
    nodes: str


SQUEUE_FORMAT = "%i|%j|%T|%r|%N"


def parse_squeue(pool: SlurmPool, text: str) -> dict[int, SlurmJob]:
    """squeue -h -o SQUEUE_FORMAT's lines: the pool's Slurm jobs by Shardyard job id (the newest
    when two name one job)."""
    out: dict[int, SlurmJob] = {}
    for line in text.splitlines():
        parts = line.strip().split("|")
        if len(parts) != 5 or not parts[0].isdigit():
            continue
        job_id = job_of_name(pool, parts[1])
        if job_id is None:
            continue
        sj = SlurmJob(int(parts[0]), job_id, parts[2], parts[3], parts[4])
        if job_id not in out or sj.slurm_id > out[job_id].slurm_id:
            out[job_id] = sj
    return out


def pending_reason(sj: SlurmJob, pool: SlurmPool) -> str:
    """A pending Slurm job's reason, as the job's wait reason."""
    where = f" in partition {pool.partition}" if pool.partition else ""
    return f"slurm job {sj.slurm_id} pending{where}: {sj.reason}"


__all__ = [
    "POOL_PREFIX",
    "SQUEUE_FORMAT",
    "Sizing",
    "SlurmJob",
    "SlurmPool",
    "SlurmSettings",
    "is_pool_node",
    "job_name",
    "job_of_name",
    "nice",
    "parse_squeue",
    "pending_reason",
    "pool_of",
    "sbatch_command",
    "sizing",
]
