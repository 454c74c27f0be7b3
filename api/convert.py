"""Table rows to public schemas."""

from __future__ import annotations

from typing import Any

from api.schemas import EventPublic, JobPublic, Progress, SelectionPublic, TrialPublic
from db.jobs import aware
from db.models import Job, JobEvent, Selection, Trial
from db.selections import trial_fields

LIST_ERROR_CHARS = 500
"""The most characters of a job's or a batch's `error` a listing page carries (brief_error)."""


def brief_error(error: str | None, *, whole_at: str) -> str | None:
    """`error` as a listing shows it: its first LIST_ERROR_CHARS characters, and where the whole
    error is (`whole_at`) when it is longer."""
    if error is None or len(error) <= LIST_ERROR_CHARS:
        return error
    return f"{error[:LIST_ERROR_CHARS]} [... {len(error)} characters in all: {whole_at} has the whole error]"


def job_public(job: Job, *, brief: bool = False) -> JobPublic:
    """`brief`: a listing's entry, with a long error cut short (brief_error)."""
    return JobPublic(
        id=job.id,
        name=job.name,
        kind=job.kind,
        status=job.status,
        priority=job.priority,
        queue=job.queue,
        world_size=job.world_size,
        attempts=job.attempts,
        created_at=aware(job.created_at),
        started_at=aware(job.started_at),
        finished_at=aware(job.finished_at),
        worker=job.worker,
        error=brief_error(job.error, whole_at=f"GET /api/jobs/{job.id}") if brief else job.error,
        result=job.result,
        spec=job.spec,
        cancel_requested=job.cancel_requested,
        progress=Progress(step=job.step, steps=job.steps, loss=job.last_loss),
        selection_id=job.selection_id,
        owner=job.user.name if job.user else None,
        wait_reason=job.wait_reason,
        run_seconds=round(job.run_seconds or 0.0, 3),
        restarts=job.restarts or 0,
        diverged=job.divergence is not None,
        divergence=job.divergence,
        **_trial_facts(job),
    )


def _trial_facts(job: Job) -> dict[str, Any]:
    """A trial's job: whether early stopping cut its trial short, and why (the trial row's, read
    only for jobs of kind `trial`)."""
    trial = job.trial if job.kind == "trial" else None
    if trial is None or not trial.stopped_early:
        return {}
    return {"stopped_early": True, "stop_reason": (trial.result or {}).get("stop_reason")}


def event_public(ev: JobEvent) -> EventPublic:
    return EventPublic(id=ev.id, time=ev.time, kind=ev.kind, message=ev.message, data=ev.data)


def leaderboard(sel: Selection) -> list[int]:
    """The ids of the batch's trials with a metric, best first (its mode), ties by index."""
    sign = 1.0 if sel.mode == "min" else -1.0
    scored = [t for t in sel.trials if t.best_metric is not None]
    return [t.id for t in sorted(scored, key=lambda t: (sign * t.best_metric, t.index))]


def trial_public(t: Trial) -> TrialPublic:
    return TrialPublic(**trial_fields(t))


def selection_public(sel: Selection, *, brief: bool = False) -> SelectionPublic:
    """`brief`: a listing's entry, with a long error cut short (brief_error)."""
    return SelectionPublic(
        id=sel.id,
        name=sel.name,
        status=sel.status,
        metric=sel.metric,
        mode=sel.mode,
        scheduler=sel.scheduler,
        created_at=aware(sel.created_at),
        started_at=aware(sel.started_at),
        finished_at=aware(sel.finished_at),
        space=sel.request.get("space", {}),
        request=sel.request,
        cancel_requested=sel.cancel_requested,
        error=brief_error(sel.error, whole_at=f"GET /api/selections/{sel.id}") if brief else sel.error,
        trials=[trial_public(t) for t in sel.trials],
        leaderboard=leaderboard(sel),
        owner=sel.user.name if sel.user else None,
    )
