"""Data functions for model-selection batches. Each trial is a Trial row plus a Job row of kind
`trial`, so its metrics, events and stream are a job's."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, cast

from sqlalchemy import delete, func, insert, select, update
from sqlalchemy.orm import Session, selectinload

from db.connection import rowcount
from db.ingest import Applied, JobLines, apply_lines
from db.jobs import (
    Attempt,
    Conflict,
    Judge,
    NotFound,
    aware,
    claim_job,
    create_job,
    db_now,
    judge_divergence,
    listing_filters,
)
from db.models import (
    TERMINAL,
    Job,
    JobEvent,
    JobStatus,
    MetricPoint,
    Reservation,
    Selection,
    Trial,
    cap_error,
    utcnow,
)
from jobrules.spec import SelectionCreate, stored_field, stored_job

TRIAL_DONE = frozenset({"succeeded", "failed", "cancelled", "stopped_early", "stopped"})


def create_selection(
    session: Session,
    *,
    name: str,
    request: dict[str, Any],
    metric: str,
    mode: str,
    scheduler: str,
    owner_id: int | None = None,
) -> Selection:
    sel = Selection(
        name=name, request=request, metric=metric, mode=mode, scheduler=scheduler, owner_id=owner_id
    )
    session.add(sel)
    session.commit()
    return sel


def add_trials(
    session: Session,
    *,
    selection_id: int,
    plans: Sequence[tuple[int, dict[str, Any], dict[str, Any]]],
    queue: str,
    warm_start_from: int | None = None,
    owner_id: int | None = None,
    actor: str | None = None,
) -> list[Trial]:
    """(index, params, spec) per trial -> Trial rows, each with its own queued Job row (owned by
    the selection's owner, also when the worker grows the batch), all in ONE transaction: when
    another process added one of these indexes first, the commit's IntegrityError leaves nothing
    behind (a trial job committed before its trial row failed stayed queued forever, its batch's
    trials never pointing at it)."""
    if owner_id is None:
        owner_id = session.scalar(select(Selection.owner_id).where(Selection.id == selection_id))
    trials = []
    for index, params, spec in plans:
        read = stored_job(spec)
        job = create_job(
            session,
            name=f"{read.name}#{index}",
            spec=spec,
            queue=queue,
            steps=read.train.steps,
            kind="trial",
            selection_id=selection_id,
            owner_id=owner_id,
            actor=actor,
            priority=read.priority,  # the batch's groups are ordered by it
            commit=False,
        )
        trials.append(
            _add_trial(
                session,
                job,
                selection_id=selection_id,
                index=index,
                params=params,
                warm_start_from=warm_start_from,
            )
        )
    # a finished batch that grows runs again; a running one stays running
    session.execute(
        update(Selection)
        .where(Selection.id == selection_id, Selection.status.in_([JobStatus.succeeded, JobStatus.failed]))
        .values(status=JobStatus.queued, finished_at=None)
    )
    session.commit()
    return trials


def _add_trial(
    session: Session, job: Job, *, selection_id: int, index: int, params: dict[str, Any], **fields: Any
) -> Trial:
    """The trial row of `job` (a new row, its steps those of the job's spec), added to `session`."""
    trial = Trial(
        selection_id=selection_id,
        index=index,
        params=params,
        job_id=job.id,
        steps_total=job.steps,
        **fields,
    )
    session.add(trial)
    return trial


ORPHAN_TRIAL_ERROR = (
    "a trial job with no trial of its batch pointing to it (left by two processes growing the "
    "batch at once): it would never run; ended by the service's check"
)


def end_orphan_trial_jobs(session: Session) -> list[int]:
    """End every trial job that no trial points to and that has not ended: it can never run (a
    trial runs only inside its batch's group), yet it counted in the queue forever. Returns their
    ids. The API runs this at its start and the reconciler with its sweep; a trial's job and its
    row are written in one transaction (add_trials, add_group_trial), so no live one is taken."""
    orphan = (
        (Job.kind == "trial")
        & Job.status.not_in(list(TERMINAL))
        & ~select(Trial.id).where(Trial.job_id == Job.id).exists()
    )
    ids = list(session.scalars(select(Job.id).where(orphan)).all())
    if not ids:
        return []
    session.execute(
        update(Job)
        .where(Job.id.in_(ids), orphan)
        .values(
            status=JobStatus.cancelled,
            error=ORPHAN_TRIAL_ERROR,
            finished_at=utcnow(),
            owner=None,
            lease_until=None,
            enqueued_at=None,
        )
        .execution_options(synchronize_session=False)
    )
    session.execute(delete(Reservation).where(Reservation.job_id.in_(ids)))
    now = time.time()
    for job_id in ids:
        data = {"error": ORPHAN_TRIAL_ERROR, "by": "orphan check"}
        session.add(JobEvent(job_id=job_id, time=now, kind="status", message="cancelled", data=data))
    session.commit()
    return ids


def trial_fields(t: Trial) -> dict[str, Any]:
    """A trial's public fields as plain JSON values: the REST body and the live channel message."""
    return {
        "id": t.id,
        "index": t.index,
        "params": t.params,
        "status": t.status,
        "steps_done": t.steps_done,
        "steps_total": t.steps_total,
        "last_metric": t.last_metric,
        "best_metric": t.best_metric,
        "stopped_early": t.stopped_early,
        "job_id": t.job_id,
        "warm_start_from": t.warm_start_from,
        "result": t.result,
        # the executor's per-trial accounting, lifted out of the result for tables
        "compute_s": (t.result or {}).get("compute_s"),
        "copy_s": (t.result or {}).get("copy_s"),
        "stop_reason": (t.result or {}).get("stop_reason"),
        "repeats_skipped": (t.result or {}).get("repeats_skipped"),
        "fused_with": (t.result or {}).get("fused_with"),
        # its job's times (Trial.started_at / finished_at: read with the trial, no query each)
        "started_at": _iso(t.started_at),
        "finished_at": _iso(t.finished_at),
    }


def _iso(dt: datetime | None) -> str | None:
    return aware(dt).isoformat() if dt is not None else None


def get_selection(session: Session, selection_id: int) -> Selection:
    sel = session.scalars(
        select(Selection).where(Selection.id == selection_id).options(selectinload(Selection.trials))
    ).first()
    if sel is None:
        raise NotFound(f"selection {selection_id} does not exist")
    return sel


def list_selections(
    session: Session,
    *,
    owner_id: int | None = None,
    status: str | None = None,
    owner: str | None = None,
    name: str | None = None,
    limit: int = 50,
    offset: int = 0,
) -> tuple[Sequence[Selection], int]:
    """A page, newest first, and the count of all matches. `owner_id` keeps one user's batches (a
    non-admin's view); `status` one status; `owner` filters by user name; `name` matches a
    substring (any case)."""
    where = listing_filters(Selection, owner_id=owner_id, status=status, owner=owner, name=name)
    total = session.scalar(select(func.count(Selection.id)).where(*where)) or 0
    rows = session.scalars(
        select(Selection)
        .where(*where)
        .options(selectinload(Selection.trials))
        .order_by(Selection.id.desc())
        .limit(limit)
        .offset(offset)
    ).all()
    return rows, total


def next_trial_index(session: Session, *, selection_id: int) -> int:
    top = session.scalar(select(func.max(Trial.index)).where(Trial.selection_id == selection_id))
    return 0 if top is None else top + 1


def get_trial(session: Session, *, selection_id: int, trial_id: int) -> Trial:
    trial = session.get(Trial, trial_id)
    if trial is None or trial.selection_id != selection_id:
        raise NotFound(f"trial {trial_id} is not in selection {selection_id}")
    return trial


def trial_of_job(session: Session, *, job_id: int) -> Trial:
    trial = session.scalars(select(Trial).where(Trial.job_id == job_id)).first()
    if trial is None:
        raise NotFound(f"job {job_id} is not a trial")
    return trial


def _group_reservation(reservation_id: int, worker: str, owner: str) -> Any:
    return (
        (Reservation.id == reservation_id)
        & (Reservation.worker == worker)
        & (Reservation.trial_ids.is_not(None))
        & (Reservation.owner.is_(None) | (Reservation.owner == owner))
    )


def group_reserved_here(
    session: Session, *, reservation_id: int, worker: str, owner: str
) -> list[int] | None:
    """The trials of the group the scheduler placed on `worker` as reservation `reservation_id`,
    when no other process has claimed it; else None. The reservation's trials, not a message's:
    an id that the database reused after a group ended names the new group."""
    q = select(Reservation.trial_ids).where(_group_reservation(reservation_id, worker, owner))
    return session.scalar(q)


def free_group(session: Session, *, reservation_id: int, worker: str, owner: str) -> None:
    """The group's slots on `worker` go back to the pool (inside the caller's transaction), only
    when process `owner` holds them or nobody does yet: a message that reached another worker, or
    a duplicate that another process runs, frees nothing."""
    session.execute(delete(Reservation).where(_group_reservation(reservation_id, worker, owner)))


def claim_trials(
    session: Session,
    *,
    trial_ids: Sequence[int],
    owner: str,
    worker: str,
    lease_s: float,
    reservation_id: int | None = None,
) -> list[tuple[Trial, Attempt]]:
    """Take the lease of each trial's job, atomically per trial (queued, or running under a lease
    that ran out); returns the trials this call won with their attempts. A redelivered group
    message finds them taken and runs nothing twice; a lost group's trials are taken back here.
    `reservation_id`: the group's reservation (core/scheduler.py placed it on `worker`) is
    claimed for `owner` in the same transaction; when it is gone or another process holds it,
    nothing is claimed."""
    if reservation_id is not None:
        res = session.execute(
            update(Reservation)
            .where(_group_reservation(reservation_id, worker, owner))
            .values(claimed_at=utcnow(), owner=owner)
        )
        if rowcount(res) != 1:
            session.rollback()
            return []
    won = []
    # one start for the group: fair share counts a group's run by the started_at its trials
    # share (db/scheduling.py recent_usage)
    now = db_now(session)
    for trial in session.scalars(
        select(Trial).where(Trial.id.in_(list(trial_ids))).order_by(Trial.index)
    ).all():
        attempt = claim_job(
            session, job_id=trial.job_id, owner=owner, worker=worker, lease_s=lease_s, kind="trial", now=now
        )
        if attempt is not None:
            trial.status = "running"
            won.append((trial, attempt))
    if won:
        session.execute(
            update(Selection)
            .where(Selection.id == won[0][0].selection_id, Selection.status == JobStatus.queued)
            .values(status=JobStatus.running, started_at=utcnow())
        )
    session.commit()
    return won


def add_group_trial(
    session: Session,
    *,
    selection_id: int,
    index: int,
    params: dict[str, Any],
    spec: dict[str, Any],
    reservation_id: int,
    worker: str,
    owner: str,
    lease_s: float,
    result: dict[str, Any] | None = None,
) -> tuple[Trial, Attempt] | None:
    """A sampler's next trial, added to a running group (workers/search.py ask_due) in ONE
    transaction: its Job row already claimed by `owner` and its id in the group's reservation, so
    the scheduler never sees it queued and places it elsewhere. None, writing nothing, when the
    group's reservation is gone or another process holds it, or the index is taken (IntegrityError
    is the caller's: another worker asked it first)."""
    res = session.scalar(select(Reservation).where(_group_reservation(reservation_id, worker, owner)))
    if res is None:
        return None
    sel = session.get(Selection, selection_id)
    assert sel is not None
    held = res.trial_ids or []  # a group's reservation holds its trials
    group_job = session.get(Job, session.scalar(select(Trial.job_id).where(Trial.id.in_(held))))
    now = db_now(session)
    read = stored_job(spec)
    job = Job(
        name=f"{read.name}#{index}",
        spec=spec,
        queue=group_job.queue if group_job is not None else "cpu",
        steps=read.train.steps,
        kind="trial",
        selection_id=selection_id,
        owner_id=sel.owner_id,
        priority=read.priority,
        status=JobStatus.running,
        enqueued_at=utcnow(),
        started_at=now,
        worker=worker,
        owner=owner,
        lease_until=now + timedelta(seconds=lease_s),
        applied_seq=-1,
        attempts=1,
    )
    session.add(job)
    session.flush()
    trial = _add_trial(
        session, job, selection_id=selection_id, index=index, params=params, status="running", result=result
    )
    session.flush()
    res.trial_ids = [*held, trial.id]
    t = time.time()
    session.add(JobEvent(job_id=job.id, time=t, kind="status", message="queued", data={"by": "search"}))
    session.add(
        JobEvent(
            job_id=job.id, time=t, kind="status", message="running", data={"worker": worker, "attempt": 1}
        )
    )
    session.commit()
    return trial, Attempt(job_id=job.id, attempt=1, owner=owner)


@dataclass(slots=True)
class TrialProgress:
    """What a batch of lines says about a trial beyond its job's lines."""

    values: list[float]
    """The batch's metric values of the selection's metric, in order (finite ones)."""
    steps_done: int | None = None
    finish: tuple[str, str | None] | None = None
    """(trial status, error) once both the trial's final event and its result were read."""
    judge: Judge | None = None
    """A trial that ended trained (succeeded, or stopped early) is judged for divergence like a
    job (db/jobs.py finish_job)."""


def apply_trial_lines(
    session: Session,
    *,
    trial_id: int,
    attempt: Attempt,
    lines: JobLines,
    progress: TrialProgress,
    mode: str,
    lease_s: float,
    now: Any,
    run_seconds: float | None = None,
) -> Applied | None:
    """A trial's share of a batch, fenced like a job's: its job's lines, its result (stored as it
    arrives), its best metric, and its end once its final event and its result are both in."""
    applied = apply_lines(
        session, attempt=attempt, lines=lines, lease_s=lease_s, now=now, run_seconds=run_seconds
    )
    if applied is None:
        return None
    trial = session.get(Trial, trial_id)
    assert trial is not None
    sign = 1.0 if mode == "min" else -1.0
    for v in progress.values:
        trial.last_metric = v
        if trial.best_metric is None or sign * v < sign * trial.best_metric:
            trial.best_metric = v
    if progress.steps_done is not None:
        trial.steps_done = max(trial.steps_done, progress.steps_done)
    if applied.result is not None:
        # the search's note (repeats it skipped for this trial) stays beside the executor's report
        note = {k: v for k, v in (trial.result or {}).items() if k == "repeats_skipped"}
        trial.result = {**note, **applied.result}
    if progress.finish is not None:
        status, error = progress.finish[0], progress.finish[1]
        divergence = None
        if progress.judge is not None and status in ("succeeded", "stopped_early"):
            # the points of this batch are in the transaction already: the whole series is read
            divergence, fail = judge_divergence(session, job_id=attempt.job_id, judge=progress.judge)
            if fail and status == "succeeded":
                status, error = "failed", f"{divergence}; train.fail_on_divergence is set"
        error = cap_error(error)
        trial.status = status
        trial.stopped_early = status == "stopped_early"
        session.execute(
            update(Job)
            .where(Job.id == attempt.job_id, Job.attempts == attempt.attempt, Job.owner == attempt.owner)
            .values(
                status=_JOB_STATUS.get(status, JobStatus.cancelled),
                error=error,
                finished_at=utcnow(),
                owner=None,
                lease_until=None,
                divergence=divergence,
            )
        )
        job_status = str(_JOB_STATUS.get(status, JobStatus.cancelled))
        ev = {"error": error, "trial_status": status}
        if divergence:
            ev["divergence"] = divergence
        row = {
            "job_id": attempt.job_id,
            "time": time.time(),
            "kind": "status",
            "message": job_status,
            "data": ev,
        }
        eid = session.scalars(insert(JobEvent).returning(JobEvent.id), [row]).one()
        applied.events.append({"id": eid, **row})
    return applied


_JOB_STATUS = {
    "succeeded": JobStatus.succeeded,
    "stopped_early": JobStatus.succeeded,
    "failed": JobStatus.failed,
}


def sync_trials(session: Session, *, job_ids: Sequence[int]) -> set[int]:
    """Bring trials in line with their jobs after the jobs changed outside a batch (a lease ran
    out, an operator failed or re-queued one). Returns the selections touched."""
    touched = set()
    for trial, job in session.execute(
        select(Trial, Job).join(Job, Job.id == Trial.job_id).where(Trial.job_id.in_(list(job_ids)))
    ):
        if job.status == JobStatus.queued:
            trial.status = "queued"
        elif job.status in TERMINAL and trial.status not in TRIAL_DONE:
            trial.status = str(job.status)
        touched.add(trial.selection_id)
    session.commit()
    return touched


def finish_trial(
    session: Session, *, trial: Trial, status: str, error: str | None = None, attempt: Attempt | None = None
) -> bool:
    """End a trial that never reported its end (its group stopped or failed under it), with its
    job; fenced by `attempt` when given. False when that attempt was fenced off."""
    job_status = _JOB_STATUS.get(status, JobStatus.cancelled)
    cond = [Job.id == trial.job_id, Job.status.not_in(list(TERMINAL))]
    if attempt is not None:
        cond += [Job.attempts == attempt.attempt, Job.owner == attempt.owner]
    res = session.execute(
        update(Job)
        .where(*cond)
        .values(status=job_status, error=error, finished_at=utcnow(), owner=None, lease_until=None)
    )
    if attempt is not None and rowcount(res) != 1:
        session.rollback()
        return False
    session.execute(
        update(Trial)
        .where(Trial.id == trial.id)
        .values(status=status, stopped_early=status == "stopped_early")
    )
    if rowcount(res) == 1:
        session.add(
            JobEvent(
                job_id=trial.job_id,
                time=time.time(),
                kind="status",
                message=str(job_status),
                data={"error": error, "trial_status": status},
            )
        )
    session.commit()
    return True


def derive_status(states: Sequence[str], *, cancel_requested: bool) -> str:
    """A batch's status is a function of its trials' (so a batch always ends once they all have)."""
    if any(s == "running" for s in states):
        return JobStatus.running
    if any(s == "queued" for s in states):
        return JobStatus.running if any(s in TRIAL_DONE for s in states) else JobStatus.queued
    if cancel_requested:
        return JobStatus.cancelled
    if states and all(s == "failed" for s in states):
        return JobStatus.failed
    return JobStatus.succeeded


GROWING_METHODS = frozenset({"tpe", "cmaes", "qmc"})
"""The samplers of core/search.py: their batches add their own trials as trials end."""


def still_growing(sel: Selection) -> bool:
    """A sampler batch is not over while it has fewer trials than it asked for, unless it was
    cancelled or its search stopped (`error`): its next trials are about to be added."""
    req = sel.request or {}
    return (
        stored_field(SelectionCreate, req, "method") in GROWING_METHODS
        and not sel.cancel_requested
        and sel.error is None
        and len(sel.trials) < (stored_field(SelectionCreate, req, "trials") or 0)
    )


def settle_selection(session: Session, *, selection_id: int) -> str:
    """Set the batch's status from its trials'."""
    sel = get_selection(session, selection_id)
    session.refresh(sel)
    for t in sel.trials:
        session.refresh(t)
    status = derive_status([t.status for t in sel.trials], cancel_requested=sel.cancel_requested)
    if status in TERMINAL and still_growing(sel):
        status = JobStatus.running
    if status != sel.status:
        sel.status = status
        sel.finished_at = utcnow() if status in TERMINAL else None
        if status == JobStatus.running and sel.started_at is None:
            sel.started_at = utcnow()
    session.commit()
    return status


def batch_over(session: Session, *, selection_id: int) -> bool:
    """Whether settling the batch now would end it (every trial ended, no trial left to
    grow), read fresh and without writing anything."""
    sel = get_selection(session, selection_id)
    session.refresh(sel)
    for t in sel.trials:
        session.refresh(t)
    status = derive_status([t.status for t in sel.trials], cancel_requested=sel.cancel_requested)
    return status in TERMINAL and not still_growing(sel)


def kept_trial(session: Session, *, selection_id: int) -> int | None:
    """Checkpoints `best` across the whole batch: the index of the one trial whose checkpoints an
    ended batch keeps, by the leaderboard's rule (best metric, then the lower index), whichever
    group or worker ran it; None when no trial reported the metric."""
    sel = get_selection(session, selection_id)
    sign = -1.0 if sel.mode == "max" else 1.0
    ranked = sorted((sign * t.best_metric, t.index) for t in sel.trials if t.best_metric is not None)
    return ranked[0][1] if ranked else None


def unsettled_selections(session: Session) -> list[int]:
    """Open batches that no running group holds: a claimed group's worker settles its batch itself,
    once its trials' checkpoints are uploaded and pruned (workers/selection.py), so a sweep that
    settled it from its trials' rows first would show it ended before then. A group whose worker
    died loses its reservation with its lease, and the sweep settles the batch after that."""
    held = (
        select(Job.selection_id)
        .join(Reservation, Reservation.job_id == Job.id)
        .where(
            Reservation.trial_ids.is_not(None), Reservation.owner.is_not(None), Job.selection_id.is_not(None)
        )
    )
    query = select(Selection.id).where(Selection.status.not_in(list(TERMINAL)), Selection.id.not_in(held))
    return list(session.scalars(query))


def cancel_selection(session: Session, *, selection_id: int) -> Selection:
    sel = get_selection(session, selection_id)
    if sel.status in TERMINAL:
        raise Conflict(f"selection {selection_id} is already {sel.status}")
    sel.cancel_requested = True
    now = time.time()
    for t in sel.trials:
        if t.status == "queued":
            t.status = "cancelled"
            session.execute(
                update(Job)
                .where(Job.id == t.job_id, Job.status == JobStatus.queued)
                .values(status=JobStatus.cancelled, cancel_requested=True, finished_at=utcnow())
            )
            session.add(JobEvent(job_id=t.job_id, time=now, kind="status", message="cancelled"))
        elif t.status == "running":
            session.execute(update(Job).where(Job.id == t.job_id).values(cancel_requested=True))
    session.commit()
    settle_selection(session, selection_id=selection_id)
    session.refresh(sel)
    return sel


def request_trial_stop(session: Session, *, selection_id: int, trial_id: int) -> Trial:
    trial = get_trial(session, selection_id=selection_id, trial_id=trial_id)
    if trial.status in TRIAL_DONE:
        raise Conflict(f"trial {trial_id} is already {trial.status}")
    if trial.status == "queued":
        finish_trial(session, trial=trial, status="stopped")
        settle_selection(session, selection_id=selection_id)
    else:
        trial.stop_requested = True
        session.commit()
    session.refresh(trial)
    return trial


def stop_requests(session: Session, *, selection_id: int) -> tuple[bool, set[int]]:
    """(batch cancel requested, indices of trials asked to stop) for the running executor."""
    sel = session.get(Selection, selection_id)
    idx = set(
        session.scalars(
            select(Trial.index).where(Trial.selection_id == selection_id, Trial.stop_requested.is_(True))
        )
    )
    return bool(sel and sel.cancel_requested), idx


def lock_selection_writes(session: Session, *, selection_id: int) -> None:
    """Take the batch's row lock for the rest of the caller's transaction (a row lock on
    Postgres; SQLite serialises every write anyway). The relays of a batch's groups take it
    before writing trial points, so their transactions commit in the order their points got
    ids: a stream's single id cursor over the batch (api/selection_stream.py) never skips a
    point that committed late."""
    session.execute(update(Selection).where(Selection.id == selection_id).values(id=Selection.id))


def selection_points_after(
    session: Session, *, selection_id: int, after_id: int, limit: int
) -> list[tuple[int, int, int, str, float, float, int]]:
    """(id, job_id, step, name, value, time, trial_id) of the batch's metric points after id
    `after_id`, in id order."""
    q = (
        select(
            MetricPoint.id,
            MetricPoint.job_id,
            MetricPoint.step,
            MetricPoint.name,
            MetricPoint.value,
            MetricPoint.time,
            Trial.id,
        )
        .join(Trial, Trial.job_id == MetricPoint.job_id)
        .where(Trial.selection_id == selection_id, MetricPoint.id > after_id)
        .order_by(MetricPoint.id)
        .limit(limit)
    )
    return [cast("tuple[int, int, int, str, float, float, int]", tuple(r)) for r in session.execute(q)]
