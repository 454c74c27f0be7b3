"""Limits a worker puts on a trainer process: host memory and wall-clock time.

Time: max_runtime_s (never more than the service's max_job_runtime_s) counts the wall time of all
of a job's attempts (jobs.run_seconds, written with each relay batch), so a job re-claimed after a
kill has only what is left of it.

Memory: a CPU job's processes run under RLIMIT_AS of about twice their share of the job's
host-memory estimate (jobrules/hostmem.py, the number admission checked) plus a fixed runtime
margin, and never more than this machine's RAM shared among the ranks. An allocation past it fails
inside the trainer (torch raises "can't allocate memory"), so the job fails on its own with "out of
host memory" and the worker and its other jobs live on. CUDA jobs are left without the limit:
the CUDA driver reserves far more address space than it ever backs with memory.
"""

from __future__ import annotations

import resource

from jobrules.hostmem import host_memory_bytes
from jobrules.spec import JobSpec
from workers.devices import host_ram_bytes

GiB = 2**30
MARGIN_BYTES = 3 * GiB
"""Address space a torch process maps beyond what it allocates (libraries, thread stacks, gloo
buffers): `import torch` alone maps ~0.6 GiB."""
_OOM_MARKS = ("can't allocate memory", "MemoryError", "Cannot allocate memory", "std::bad_alloc")


def memory_limit_bytes(spec: JobSpec, *, ram_bytes: int | None = None) -> int | None:
    """Per-process address-space limit for this job, or None (CUDA jobs)."""
    if spec.gpus:
        return None
    ranks = spec.parallel.world_size
    share = 2 * host_memory_bytes(spec.model_dump())["total"] // ranks + MARGIN_BYTES
    ram = ram_bytes or host_ram_bytes()
    return int(min(share, max(ram // ranks, MARGIN_BYTES)))


def group_memory_limit_bytes(specs: list[JobSpec], *, ram_bytes: int | None = None) -> int | None:
    """Address-space limit of a selection group's one process, or None (CUDA trials). All its
    trials live in that process (HYDRA keeps idle models in host memory), so the limit is twice
    the sum of their estimates plus the runtime margin, never more than this machine's RAM."""
    if not specs or any(s.gpus for s in specs):
        return None
    total = sum(host_memory_bytes(s.model_dump())["total"] for s in specs)
    ram = ram_bytes or host_ram_bytes()
    return int(min(2 * total + MARGIN_BYTES, max(ram, MARGIN_BYTES)))


def apply_memory_limit(limit: int | None, *, pid: int = 0) -> None:
    """In the child before exec (children inherit it: torchrun's ranks too), or with `pid`, on
    that process of this user before it starts (a warm run, workers/warm.py)."""
    if limit is not None:
        resource.prlimit(pid, resource.RLIMIT_AS, (limit, limit))


def runtime_limit_s(spec: JobSpec, *, service_max_s: float) -> float:
    """The job's own max_runtime_s, never more than the service's max_job_runtime_s."""
    own = spec.max_runtime_s
    return min(float(own), service_max_s) if own else service_max_s


def runtime_error(limit_s: float, earlier_s: float) -> str:
    """Why a job (or trial) was stopped at its runtime limit, which counts every attempt."""
    earlier = f", {earlier_s:.1f} s of it in earlier attempts" if earlier_s > 0 else ""
    return f"ran past its max_runtime_s ({limit_s:g} s over all its attempts{earlier}) and was stopped"


def out_of_memory_error(*, error: str | None, stderr_tail: list[str], limit: int | None) -> str | None:
    """The readable failure when the trainer ran out of its host-memory limit, else None."""
    if limit is None:
        return None
    text = "\n".join([error or "", *stderr_tail])
    if not any(mark in text for mark in _OOM_MARKS):
        return None
    return (
        f"out of host memory: a trainer process needed more than its limit of {limit / GiB:.1f} GiB "
        "(twice its share of the job's estimate plus a runtime margin); shrink the model, "
        "batch_size or seq_len"
    )
