"""Each run's share of this host's cores, for a worker that runs several jobs at once.

A Celery worker started with `--concurrency N` runs up to N jobs (or selection groups) at once,
one per pool process. Each run is told its share, the worker's CPU budget over N (at least one;
the budget is the CPUs the worker may run on, or fewer under a container's CPU quota, as Celery
counts `--concurrency auto`), as `SHARDYARD_TRAINER_CORES` in its environment (workers/sandbox.py), and keeps its torch
threads to it (trainer/priority.py `use_cores`). The worker learns N before its pool processes
are forked (`set_tasks`, at Celery's worker_init), so every pool process knows it. Outside a
worker (a benchmark, `python -m trainer` by hand) no share is given and a run keeps torch's
default. The Slurm node agent gives its run the CPUs Slurm allocated it on the node (`set_share`),
which the host's other jobs do not use. `SHARDYARD_TRAINER_CORES` sets the share instead (an
operator's choice; on a Slurm node it can only lower the allocation's).

The share is fixed, whatever runs beside a run: a job alone on a worker with `--concurrency 2`
keeps to its half. A share that followed the runs beside it (every core while alone) was built
and measured: on the 2-core dev VM, a job alone with both cores took 2.33x as long as on its one
(bench/run_cores.py), since the worker relaying its metrics, the API and the database share those
cores with it and each parallel region of a step waits for the thread that has none. And a run's
numbers depend on its thread count (the reductions split differently): with a share that follows,
a job's result would depend on what ran beside it. `--concurrency 1`, or
`SHARDYARD_TRAINER_CORES`, gives one job every core.
"""

from __future__ import annotations

import os

from core.settings import Settings

_TASKS: list[int] = []
_CORES: list[int] = []
_FIXED: list[int] = []


def set_tasks(tasks: int, *, cores: int | None = None) -> None:
    """This worker runs up to `tasks` runs at once (its --concurrency), on `cores` (its CPU
    budget; default: the CPUs this process may run on)."""
    _TASKS[:] = [max(1, int(tasks))]
    _CORES[:] = [max(1, int(cores))] if cores else []


def set_share(cores: int) -> None:
    """Each run of this process gets `cores` (the Slurm node agent: the CPUs of its allocation on
    its node, core/slurm.py's `srun --cpus-per-task`)."""
    _FIXED[:] = [max(1, int(cores))]


def run_share(settings: Settings) -> int | None:
    """The cores one run of this worker may use: the share this process was given (`set_share`,
    a Slurm allocation), no more than SHARDYARD_TRAINER_CORES where that is set too; else that
    setting; else the cores over the runs it holds at once; or None where no worker said how
    many that is."""
    if _FIXED:
        return min(_FIXED[0], settings.trainer_cores or _FIXED[0])
    if settings.trainer_cores:
        return settings.trainer_cores
    if not _TASKS:
        return None
    return max(1, (_CORES[0] if _CORES else len(os.sched_getaffinity(0))) // _TASKS[0])
