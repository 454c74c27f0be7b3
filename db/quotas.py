"""Per-user quotas at claim time: jobs running at once, their ranks and their GPUs.

`quota_gate` runs in the claiming worker's session just before the claim. It first writes to the
owner's row, which takes the owner's lock (a row lock on Postgres, the database write lock on
SQLite) until the claim commits, so two workers claiming two jobs of one user count one after the
other and never both squeeze under the limit.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import select, update
from sqlalchemy.orm import Session

from db.models import Job, JobStatus, User


def job_gpus(spec: dict[str, Any]) -> int:
    res = spec.get("resources") or {}
    return max(int(res.get("gpus", 0) or 0), 1 if res.get("device") == "cuda" else 0)


def quota_reason(
    name: str, limits: dict[str, int], *, running: int, ranks: int, gpus: int, job_ranks: int, job_gpus: int
) -> str | None:
    """Why one more job (job_ranks, job_gpus) would take user `name` over `limits` given what
    their other jobs hold (`running` jobs, `ranks`, `gpus`); None when it fits."""
    if running + 1 > limits["running_jobs"]:
        return f"{running} of {name}'s jobs are running, the quota is {limits['running_jobs']}"
    if ranks + job_ranks > limits["ranks"]:
        return f"{name}'s running jobs use {ranks} ranks; this one needs {job_ranks} more, the quota is {limits['ranks']}"
    if gpus + job_gpus > limits["gpus"]:
        return f"{name}'s running jobs use {gpus} GPU(s); this one needs {job_gpus} more, the quota is {limits['gpus']}"
    return None


def quota_gate(session: Session, *, job_id: int, defaults: dict[str, int]) -> str | None:
    """None when job `job_id` may start now: the transaction is left open holding the owner's lock
    for the caller's claim to commit. Otherwise the reason it must wait, recorded on the job
    (committed). `defaults`: {running_jobs, ranks, gpus} for users without their own limits."""
    job = session.get(Job, job_id)
    if job is None or job.owner_id is None or job.status != JobStatus.queued or job.kind != "job":
        return None
    session.execute(update(User).where(User.id == job.owner_id).values(id=User.id))  # the lock
    user = session.get(User, job.owner_id)
    own = {"running_jobs": user.max_running_jobs, "ranks": user.max_ranks, "gpus": user.max_gpus}
    limits = {k: v if own[k] is None else own[k] for k, v in defaults.items()}
    # a selection's trials share the devices of their batch's worker task and are not counted here
    running = session.execute(
        select(Job.world_size, Job.spec).where(
            Job.owner_id == job.owner_id,
            Job.status == JobStatus.running,
            Job.kind == "job",
            Job.id != job_id,
        )
    ).all()
    reason = quota_reason(
        user.name,
        limits,
        running=len(running),
        ranks=sum(r.world_size for r in running),
        gpus=sum(job_gpus(r.spec) for r in running),
        job_ranks=job.world_size,
        job_gpus=job_gpus(job.spec),
    )
    session.execute(update(Job).where(Job.id == job_id).values(wait_reason=reason))
    if reason is not None:
        session.commit()
    return reason


def waiting_jobs(session: Session, *, owner_id: int) -> list[tuple[int, str]]:
    """(id, queue) of the owner's queued jobs held back by the quota, oldest first."""
    q = (
        select(Job.id, Job.queue)
        .where(Job.owner_id == owner_id, Job.status == JobStatus.queued, Job.wait_reason.is_not(None))
        .order_by(Job.priority.desc(), Job.id)
    )
    return [(r.id, r.queue) for r in session.execute(q)]
