"""Data functions for model-selection batches. Each trial is a Trial row plus a Job row of kind
`trial`, so its metrics, events and stream are a job's."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from sqlalchemy import func, select, update
from sqlalchemy.orm import Session, selectinload

from db.jobs import Conflict, NotFound, create_job
from db.models import TERMINAL, Job, JobEvent, JobStatus, Selection, Trial, utcnow

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
    the selection's owner)."""
    trials = []
    for index, params, spec in plans:
        job = create_job(
            session,
            name=f"{spec.get('name', 'trial')}#{index}",
            spec=spec,
            queue=queue,
            steps=spec["train"]["steps"],
            kind="trial",
            selection_id=selection_id,
            owner_id=owner_id,
            actor=actor,
        )
        trial = Trial(
            selection_id=selection_id,
            index=index,
            params=params,
            job_id=job.id,
            steps_total=spec["train"]["steps"],
            warm_start_from=warm_start_from,
        )
        session.add(trial)
        trials.append(trial)
    # a finished batch that grows runs again; a running one stays running
    session.execute(
        update(Selection)
        .where(Selection.id == selection_id, Selection.status.in_([JobStatus.succeeded, JobStatus.failed]))
        .values(status=JobStatus.queued, finished_at=None)
    )
    session.commit()
    return trials


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
    }


def get_selection(session: Session, selection_id: int) -> Selection:
    sel = session.scalars(
        select(Selection).where(Selection.id == selection_id).options(selectinload(Selection.trials))
    ).first()
    if sel is None:
        raise NotFound(f"selection {selection_id} does not exist")
    return sel


def list_selections(
    session: Session, *, owner_id: int | None = None, limit: int = 50, offset: int = 0
) -> tuple[Sequence[Selection], int]:
    """A page, newest first; `owner_id` keeps one user's batches."""
    where = [] if owner_id is None else [Selection.owner_id == owner_id]
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


def claim_trials(session: Session, *, trial_ids: Sequence[int], worker: str) -> list[Trial]:
    """queued -> running for each trial's job, atomically per trial; returns the ones this call won
    (a redelivered group message finds them taken and runs nothing twice)."""
    won = []
    for trial in session.scalars(select(Trial).where(Trial.id.in_(list(trial_ids))).order_by(Trial.index)):
        res = session.execute(
            update(Job)
            .where(Job.id == trial.job_id, Job.status == JobStatus.queued, Job.cancel_requested.is_(False))
            .values(status=JobStatus.running, started_at=utcnow(), worker=worker, attempts=Job.attempts + 1)
        )
        if res.rowcount == 1:
            trial.status = "running"
            won.append(trial)
    if won:
        session.execute(
            update(Selection)
            .where(Selection.id == won[0].selection_id, Selection.status == JobStatus.queued)
            .values(status=JobStatus.running, started_at=utcnow())
        )
    session.commit()
    return won


def update_trial(session: Session, *, trial_id: int, **values: Any) -> None:
    session.execute(update(Trial).where(Trial.id == trial_id).values(**values))
    session.commit()


def finish_trial(
    session: Session, *, trial: Trial, status: str, error: str | None = None, result: dict | None = None
) -> None:
    """The trial's own status (may be `stopped_early`) and its job's terminal status."""
    job_status = {
        "succeeded": JobStatus.succeeded,
        "stopped_early": JobStatus.succeeded,
        "failed": JobStatus.failed,
    }.get(status, JobStatus.cancelled)
    session.execute(
        update(Trial)
        .where(Trial.id == trial.id)
        .values(status=status, stopped_early=status == "stopped_early")
    )
    session.execute(
        update(Job)
        .where(Job.id == trial.job_id, Job.status.not_in(list(TERMINAL)))
        .values(status=job_status, error=error, result=result, finished_at=utcnow())
    )
    session.commit()


def settle_selection(session: Session, *, selection_id: int) -> str:
    """Derive the batch's status from its trials once none is queued or running."""
    sel = get_selection(session, selection_id)
    session.refresh(sel)
    states = [t.status for t in sel.trials]
    if any(s in ("queued", "running") for s in states):
        return sel.status
    status = JobStatus.cancelled if sel.cancel_requested else JobStatus.succeeded
    if states and all(s == "failed" for s in states):
        status = JobStatus.failed
    sel.status = status
    sel.finished_at = utcnow()
    session.commit()
    return status


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
        session.add(JobEvent(job_id=trial.job_id, time=time.time(), kind="status", message="cancelled"))
        session.commit()
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
