"""Table rows to public schemas."""

from __future__ import annotations

from datetime import datetime
from typing import Any, TypeVar

from pydantic import BaseModel
from sqlalchemy import inspect

from api.schemas import EventPublic, JobPublic, Progress, SelectionPublic, TrialPublic
from db.jobs import aware
from db.models import Base, Job, JobEvent, Selection, Trial
from db.selections import trial_fields

PublicT = TypeVar("PublicT", bound=BaseModel)

LIST_ERROR_CHARS = 500
"""The most characters of a job's or a batch's `error` a listing page carries (brief_error)."""


def brief_error(error: str | None, *, whole_at: str) -> str | None:
    """`error` as a listing shows it: its first LIST_ERROR_CHARS characters, and where the whole
    error is (`whole_at`) when it is longer."""
    if error is None or len(error) <= LIST_ERROR_CHARS:
        return error
    return f"{error[:LIST_ERROR_CHARS]} [... {len(error)} characters in all: {whole_at} has the whole error]"


def from_row(model: type[PublicT], row: Base, **given: Any) -> PublicT:
    """`model` from the table row `row`: each field named like one of the row's columns is the
    column's value (a time made timezone-aware: aware); `given` holds the other fields and those
    whose public value is not the column's (`owner` a name where the column is an id, say)."""
    names = _COPIED.get((model, type(row)))
    if names is None:
        columns = inspect(row).mapper.column_attrs.keys()
        names = _COPIED[(model, type(row))] = tuple(n for n in model.model_fields if n in columns)
    copied = {n: getattr(row, n) for n in names if n not in given}
    return model(**{k: aware(v) if isinstance(v, datetime) else v for k, v in copied.items()}, **given)


_COPIED: dict[tuple[type[BaseModel], type[Base]], tuple[str, ...]] = {}
"""The fields `from_row` copies from a table's columns, per schema and table (a listing makes 50
of one kind: the mapper's inspection and the set arithmetic once, not once a row)."""


def job_public(job: Job, *, brief: bool = False) -> JobPublic:
    """`brief`: a listing's entry, with a long error cut short (brief_error)."""
    return from_row(
        JobPublic,
        job,
        error=brief_error(job.error, whole_at=f"GET /api/jobs/{job.id}") if brief else job.error,
        progress=Progress(step=job.step, steps=job.steps, loss=job.last_loss),
        owner=job.user.name if job.user else None,
        run_seconds=round(job.run_seconds or 0.0, 3),
        restarts=job.restarts or 0,
        diverged=job.divergence is not None,
        # given, not defaulted: pydantic deep-copies a mutable default for each model it makes
        reservation=[],
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
    return from_row(
        SelectionPublic,
        sel,
        space=sel.request.get("space", {}),
        error=brief_error(sel.error, whole_at=f"GET /api/selections/{sel.id}") if brief else sel.error,
        trials=[trial_public(t) for t in sel.trials],
        leaderboard=leaderboard(sel),
        owner=sel.user.name if sel.user else None,
    )
