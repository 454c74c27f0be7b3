"""Admission at submit: refuse a job that could never run, with the numbers.

Never means: over the submitting user's own quota even with nothing else running, or beyond every
live worker's inventory (rank slots, GPUs, host RAM against jobrules/hostmem.py's estimate) and
beyond any gang of equal shares over several live workers. A job
that fits but must wait (the user's other jobs fill the quota, workers are busy) is accepted and
waits queued. With no live worker at all the job is accepted too: workers may be restarting.
"""

from __future__ import annotations

from sqlalchemy.orm import Session

from api.placement import placement_problem
from api.schemas import JobSpec
from core.scheduler import Want, box_of, gang_shape
from core.settings import Settings
from db.models import User
from db.workers import live_workers
from jobrules.hostmem import host_memory_bytes
from jobrules.spec import stored_job

GiB = 2**30


def user_quotas(user: User, settings: Settings) -> dict[str, int]:
    """The user's limits: their own row's, or the service defaults."""

    own = {"running_jobs": user.max_running_jobs, "ranks": user.max_ranks, "gpus": user.max_gpus}
    return {k: v if own[k] is None else own[k] for k, v in settings.quota_defaults.items()}


def quota_problem(spec: JobSpec, *, user: User, settings: Settings) -> str | None:
    q = user_quotas(user, settings)
    ranks, gpus = spec.parallel.world_size, spec.gpus
    if q["running_jobs"] < 1:
        return f"user {user.name} may run no jobs (quota running_jobs = {q['running_jobs']})"
    if ranks > q["ranks"]:
        return (
            f"parallel: the job needs {ranks} ranks, more than user {user.name}'s quota of "
            f"{q['ranks']} ranks, so it could never start"
        )
    if gpus > q["gpus"]:
        return (
            f"resources.gpus: the job needs {gpus} GPU(s), more than user {user.name}'s quota of "
            f"{q['gpus']}, so it could never start"
        )
    return None


def inventory_problem(session: Session, spec: JobSpec, settings: Settings) -> str | None:
    workers = live_workers(session, within_s=settings.worker_alive_s)
    hosts = [w.devices.get("host") or {} for w in workers]
    hosts = [h for h in hosts if h.get("slots") and h.get("ram_bytes")]
    if not hosts:
        return None  # no worker reported an inventory yet
    ranks = spec.parallel.world_size
    most_slots = max(h["slots"] for h in hosts)
    need = host_memory_bytes(spec.model_dump())
    if ranks > most_slots:
        # wider than any one worker: a gang of equal shares over several (the scheduler places it)
        boxes = [b for b in (box_of(w) for w in workers) if b is not None]
        want = _what_if(ranks=ranks, gpus=spec.gpus, ram=need["total"], queue=spec.queue)
        if gang_shape(want, boxes) is not None:
            return None
        return (
            f"parallel: the job needs {ranks} ranks; the largest live worker has {most_slots} slots "
            f"and no gang of equal shares over the {len(hosts)} live worker(s) can hold them (the "
            f"ranks must divide evenly over the nodes, each node's share within one worker's slots "
            f"and RAM)"
        )
    fits = [h for h in hosts if h["slots"] >= ranks]
    most_ram = max(h["ram_bytes"] for h in fits)
    if need["total"] > most_ram:
        return (
            f"host memory: the job needs about {need['total'] / GiB:,.1f} GiB (model state "
            f"{need['model_state'] / GiB:,.1f} GiB: parameters, gradients and optimizer state; "
            f"activations {need['activations'] / GiB:,.1f} GiB; {ranks} rank runtime(s) "
            f"{need['runtime'] / GiB:,.1f} GiB), more than the {most_ram / GiB:,.1f} GiB of RAM of "
            f"the largest live worker with room for {ranks} rank(s); shrink the model, batch_size or seq_len"
        )
    return None


def _what_if(*, ranks: int, gpus: int, ram: int, queue: str) -> Want:
    """A job of nobody's, to ask the scheduler's placement whether the live workers could hold it."""
    return Want(id=0, user=None, priority=0, created=0.0, ranks=ranks, gpus=gpus, ram=ram, queue=queue)


def group_problem(
    session: Session,
    *,
    specs: list[dict],
    devices: int,
    group_size: int,
    settings: Settings,
    user: User,
) -> str | None:
    """Why the groups of a selection batch could never run: each group is one process over the
    batch's `devices` on ONE worker (core/scheduler.py places it like a job that can never be a
    gang), so `devices` must be within the user's rank quota and some live worker must hold the
    largest group (its devices, GPUs, and its trials' host memory together). `specs`: the trials'
    specs in index order."""
    q = user_quotas(user, settings)
    if devices > q["ranks"]:
        return (
            f"devices: each group of the batch runs on {devices} device slot(s), more than user "
            f"{user.name}'s quota of {q['ranks']} ranks, so it could never start"
        )
    workers = live_workers(session, within_s=settings.worker_alive_s)
    boxes = [b for b in (box_of(w) for w in workers) if b is not None]
    if not boxes or not specs:
        return None  # no worker reported an inventory yet
    first = stored_job(specs[0])  # one base: every trial's resources are the first's
    gpus = devices if first.gpus else 0
    rams = [host_memory_bytes(s)["total"] for s in specs]
    ram = max(sum(rams[i : i + group_size]) for i in range(0, len(rams), group_size))
    group = _what_if(ranks=devices, gpus=gpus, ram=ram, queue=first.queue)
    if gang_shape(group, boxes) == 1:
        return None
    most = max(boxes, key=lambda b: (b.slots, b.ram))
    return (
        f"devices: each group of the batch runs as one process on one worker over {devices} device "
        f"slot(s) with {gpus} GPU(s) and about {ram / GiB:,.1f} GiB of host memory for its trials "
        f"(up to group_size={group_size} of them); no live worker can hold that (largest: "
        f"{most.slots} slots, {most.gpus} GPU(s), {most.ram / GiB:,.1f} GiB); lower devices or group_size"
    )


def trial_count_problem(*, field: str, has: int, adding: int, settings: Settings) -> str | None:
    """Why a selection batch may not grow to `has + adding` trials (`selection_max_trials`), naming
    `field` and the numbers; checked before any trial is expanded or validated (a thousand trials
    cost the API seconds)."""
    cap = settings.selection_max_trials
    if cap <= 0 or has + adding <= cap:
        return None
    now = (
        f"the batch has {has} trial(s) and this adds {adding}"
        if has
        else f"the batch would start with {adding} trials"
    )
    return (
        f"{field}: {now}, {has + adding} in all; a selection batch holds at most {cap} trials "
        f"(SHARDYARD_SELECTION_MAX_TRIALS): submit another batch for the rest"
    )


def admission_problem(session: Session, spec: JobSpec, *, settings: Settings, user: User) -> str | None:
    return (
        quota_problem(spec, user=user, settings=settings)
        or placement_problem(session, spec, settings)
        or inventory_problem(session, spec, settings)
    )
