"""Per-user quotas at claim time: jobs running at once, their ranks and their GPUs.

`quota_gate` (a job) and `group_quota_gate` (a group of a selection batch's trials) run in the
claiming worker's session just before the claim. They first write to the owner's row, which takes
the owner's lock (a row lock on Postgres, the database write lock on SQLite) until the claim
commits, so two workers claiming for one user count one after the other and never both squeeze
under the limit.

What a selection's trials count: a group of trials runs as ONE trainer process over the batch's
`devices` devices (shard alternation: its trials take turns on them, idle ones wait in host
memory). So a running group counts as one running job using `devices` ranks (and `devices` GPUs
when its trials are CUDA runs), however many trials it holds; a group is the trials of one batch
held by one worker process (their jobs' `owner`). A batch split into several groups counts once per
group running at the time.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from sqlalchemy import select, update
from sqlalchemy.orm import Session

from db.models import Job, JobStatus, Selection, Trial, User
from jobrules.spec import JobSpec, ResourceSpec, SelectionCreate, stored_field


def job_gpus(spec: Mapping[str, Any]) -> int:
    """GPUs a stored job spec holds (JobSpec.gpus; only its resources are read: this runs per row)."""
    resources: ResourceSpec = stored_field(JobSpec, spec, "resources")
    return resources.gpus_held


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


def group_size(request: Mapping[str, Any], spec: Mapping[str, Any]) -> tuple[int, int]:
    """(ranks, gpus) a group of a batch uses: the batch's devices, GPUs when its trials run on CUDA."""
    devices: int = stored_field(SelectionCreate, request, "devices")
    return devices, devices if job_gpus(spec) else 0


def running_groups(
    session: Session, *, owner_id: int | None = None, skip: Sequence[int] = ()
) -> list[tuple[int | None, int, int]]:
    """(owner id, ranks, gpus) of each running selection group (of one user when `owner_id` is
    given), leaving out the trial jobs `skip`. A group is the running trials of one batch held
    by one worker process (their jobs' lease `owner`)."""
    where = [Job.status == JobStatus.running, Job.kind == "trial", Job.id.not_in(list(skip))]
    if owner_id is not None:
        where.append(Job.owner_id == owner_id)
    groups: dict[tuple[int | None, str | None], tuple[int | None, int, int]] = {}
    for sel_id, holder, user_id, request, spec in session.execute(
        select(Job.selection_id, Job.owner, Job.owner_id, Selection.request, Job.spec)
        .join(Selection, Selection.id == Job.selection_id)
        .where(*where)
    ):
        groups[(sel_id, holder)] = (user_id, *group_size(request, spec))
    return list(groups.values())


def _usage(session: Session, owner_id: int, skip: Sequence[int]) -> tuple[int, int, int]:
    """(running jobs and groups, their ranks, their GPUs) of the user, leaving out jobs `skip`."""
    jobs = session.execute(
        select(Job.world_size, Job.spec).where(
            Job.owner_id == owner_id,
            Job.status == JobStatus.running,
            Job.kind == "job",
            Job.id.not_in(list(skip)),
        )
    ).all()
    groups = running_groups(session, owner_id=owner_id, skip=skip)
    units = len(jobs) + len(groups)
    ranks = sum(r.world_size for r in jobs) + sum(r for _, r, _ in groups)
    gpus = sum(job_gpus(r.spec) for r in jobs) + sum(g for _, _, g in groups)
    return units, ranks, gpus


def _check(
    session: Session, user: User, defaults: dict[str, int], skip: Sequence[int], need: tuple[int, int]
) -> str | None:
    own = {"running_jobs": user.max_running_jobs, "ranks": user.max_ranks, "gpus": user.max_gpus}
    limits = {k: v if (mine := own[k]) is None else mine for k, v in defaults.items()}
    running, ranks, gpus = _usage(session, user.id, skip)
    return quota_reason(
        user.name, limits, running=running, ranks=ranks, gpus=gpus, job_ranks=need[0], job_gpus=need[1]
    )


def _lock_owner(session: Session, owner_id: int) -> User:
    session.execute(update(User).where(User.id == owner_id).values(id=User.id))  # the lock
    user = session.get(User, owner_id)
    assert user is not None
    return user


def quota_gate(session: Session, *, job_id: int, defaults: dict[str, int]) -> str | None:
    """None when job `job_id` may start now: the transaction is left open holding the owner's lock
    for the caller's claim to commit. Otherwise the reason it must wait, recorded on the job
    (committed). `defaults`: {running_jobs, ranks, gpus} for users without their own limits."""
    job = session.get(Job, job_id)
    if job is None or job.owner_id is None or job.status != JobStatus.queued or job.kind != "job":
        return None
    user = _lock_owner(session, job.owner_id)
    reason = _check(session, user, defaults, [job_id], (job.world_size, job_gpus(job.spec)))
    session.execute(update(Job).where(Job.id == job_id).values(wait_reason=reason))
    if reason is not None:
        session.commit()
    return reason


def group_quota_gate(session: Session, *, trial_ids: Sequence[int], defaults: dict[str, int]) -> str | None:
    """Like `quota_gate`, for a group of one batch's trials about to be claimed together: None
    when the group may start (the owner's lock held for the claim), else the reason, recorded on
    the queued trials' jobs (committed). The group's own trials are left out of the count (a
    group taken back after its worker died is still `running` until claimed again)."""
    rows = session.execute(
        select(Job.id, Job.status, Job.spec, Selection.owner_id, Selection.request)
        .join(Trial, Trial.job_id == Job.id)
        .join(Selection, Selection.id == Trial.selection_id)
        .where(Trial.id.in_(list(trial_ids)))
    ).all()
    if not rows or rows[0].owner_id is None:
        return None
    user = _lock_owner(session, rows[0].owner_id)
    job_ids = [r.id for r in rows]
    need = group_size(rows[0].request, rows[0].spec)
    reason = _check(session, user, defaults, job_ids, need)
    queued = [r.id for r in rows if r.status == JobStatus.queued]
    session.execute(update(Job).where(Job.id.in_(queued)).values(wait_reason=reason))
    if reason is not None:
        session.commit()
    return reason


def waiting_jobs(session: Session, *, owner_id: int) -> list[tuple[int, str]]:
    """(id, queue) of the owner's queued jobs held back by the quota, oldest first."""
    q = (
        select(Job.id, Job.queue)
        .where(
            Job.owner_id == owner_id,
            Job.status == JobStatus.queued,
            Job.kind == "job",
            Job.wait_reason.is_not(None),
        )
        .order_by(Job.priority.desc(), Job.id)
    )
    return [(r.id, r.queue) for r in session.execute(q)]
