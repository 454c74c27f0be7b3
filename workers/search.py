"""Grows a sampler batch (method tpe, cmaes or qmc) one trial at a time, as trials end.

Two paths ask the next trials, both from the same replay (core/search.py `request_plan`: the batch's
seed, its trials' values, and the logical clock that says which trials each ask is told), so
whichever asks, and whenever, the same trials come out:

- `ask_due`: a running group's executor asks when a device of it frees (the worker
  answers from workers/selection.py); every trial due now (one, or two: the batch's last trial is
  due with the one before it) joins that group, claimed by it in the same transaction that adds
  it, so it never waits for the scheduler or a new process.
- `grow`: when no trial of the batch is running or queued (the group ended without asking, or a
  worker died between its group's end and the ask), the worker that ends a group and the reconciler
  (workers/tasks.py) add every trial that may be asked now; the scheduler (core/scheduler.py)
  places them in groups like the batch's first ones.

Trial k may be asked once the trials its ask is told (the clock's) have ended. Two processes that
ask at the same moment both compute the same trial: the unique (selection, index) index lets one
add it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from sqlalchemy import select, update
from sqlalchemy.exc import IntegrityError, OperationalError
from sqlalchemy.orm import Session

from core.search import SAMPLERS, Plan, request_plan
from core.settings import Settings
from db.connection import session_for
from db.jobs import Attempt
from db.models import Job, Reservation, Selection, Trial
from db.selections import TRIAL_DONE, add_group_trial, add_trials, get_selection
from jobrules.space import apply_params
from jobrules.spec import SelectionCreate, stored_field
from workers.workspace import owned_row

log = logging.getLogger(__name__)


@dataclass(slots=True)
class NewTrial:
    trial: Trial
    attempt: Attempt
    spec: dict[str, Any]


def grow(settings: Settings, *, selection_id: int) -> list[int]:
    """Add the trials the batch may ask now, when none of its trials runs or waits; returns the
    new trial ids. A search that cannot go on says why in the selection's `error`, and the batch
    settles."""
    try:
        return _grow(settings, selection_id=selection_id)
    except OperationalError:  # a locked or unreachable database: the reconciler asks again
        log.warning("selection %d: the database was busy; its next trials wait", selection_id)
        return []
    except Exception as e:  # noqa: BLE001 - the group's own results are in; report, do not lose them
        log.exception("selection %d: the search could not ask its next trials", selection_id)
        _give_up(settings, selection_id=selection_id, reason=f"{type(e).__name__}: {e}")
        return []


def ask_due(
    settings: Settings,
    *,
    selection_id: int,
    reservation_id: int,
    worker: str,
    owner: str,
    limit: int | None = None,
) -> list[NewTrial]:
    """Every trial of the batch that may be asked now (at most `limit`), in index order, each added
    to the running group `reservation_id` and claimed by `owner`: usually one, two where the clock
    asks two at once (the batch's last trial with the one before it: core/search.py TAIL). Never
    raises: a failure answers what was added so far, and the group's end (`grow`) asks again."""
    out: list[NewTrial] = []
    try:
        with session_for(settings.database_url) as s:
            sel, req, trials = _batch(s, selection_id)
            if sel is None:
                return out
            k0 = len(trials)
            got = _replay(s, sel=sel, req=req, trials=trials, upto=None if limit is None else k0 + limit)
            if got is None:
                return out
            base = _owned_base(s, sel=sel, req=req)
            for k, asked in enumerate(got.trials[k0:], start=k0):
                spec = apply_params(base, asked.params)
                try:
                    new = add_group_trial(
                        s,
                        selection_id=selection_id,
                        index=k,
                        params=asked.params,
                        spec=spec,
                        reservation_id=reservation_id,
                        worker=worker,
                        owner=owner,
                        lease_s=settings.lease_s,
                        result=_note(asked.repeats),
                    )
                except IntegrityError:
                    s.rollback()  # another process asked it first
                    return out
                if new is None:
                    return out
                out.append(NewTrial(trial=new[0], attempt=new[1], spec=spec))
            return out
    except Exception:  # noqa: BLE001 - the running trials go on; the group's end asks again
        log.exception("selection %d: the search could not ask its next trial", selection_id)
        return out


def _owned_base(s: Session, *, sel: Selection, req: dict[str, Any]) -> dict[str, Any]:
    """The batch's base spec, checked as the worker checks a job's workspace before it runs: the
    API stored it pinned to a digest, and the batch's owner must hold a workspace of those bytes
    (a request written past the API, or stored before bases were pinned, names one by id or
    another user's). WorkspaceRefused otherwise, which stops the search with the reason."""
    base: dict[str, Any] = req["base"]
    if base.get("workspace") is not None:
        owned_row(s, base["workspace"], owner_id=sel.owner_id)
    return base


def _note(repeats: tuple[int, ...]) -> dict[str, Any] | None:
    return {"repeats_skipped": list(repeats)} if repeats else None


def _give_up(settings: Settings, *, selection_id: int, reason: str) -> None:
    with session_for(settings.database_url) as s:
        s.execute(
            update(Selection)
            .where(Selection.id == selection_id)
            .values(error=f"the search stopped before its last trial: {reason}")
        )
        s.commit()


def _batch(s: Session, selection_id: int) -> tuple[Selection | None, dict[str, Any], list[Trial]]:
    """The batch when it is a sampler's with trials left to ask; else (None, ...)."""
    sel = get_selection(s, selection_id)
    req: dict[str, Any] = dict(sel.request)
    method, total = stored_field(SelectionCreate, req, "method"), stored_field(SelectionCreate, req, "trials")
    trials = sorted(sel.trials, key=lambda t: t.index)
    if method not in SAMPLERS or sel.cancel_requested or sel.error or len(trials) >= (total or 0):
        return None, req, trials
    return sel, req, trials


def _replay(
    s: Session, *, sel: Selection, req: dict[str, Any], trials: list[Trial], upto: int | None
) -> Plan | None:
    """The sampler's replay from the batch's ended trials (core/search.py `request_plan`), checked
    against the stored trials; None when no new trial may be asked yet. A space every point of
    which has a trial ends the search here (the selection's `error` says so)."""
    # a trial's value is its best metric; failed, or none: a failure
    values = {
        t.index: None if t.status == "failed" else t.best_metric for t in trials if t.status in TRIAL_DONE
    }
    got = request_plan(req, values=values, upto=upto)
    if len(got.trials) <= len(trials) and not got.exhausted:
        return None  # trial k waits for a trial its ask is told
    if [a.params for a in got.trials[: len(trials)]] != [t.params for t in trials]:
        # the replay must ask what was asked: anything else means a different sampler version
        # or a batch edited by hand, and the search cannot go on reproducibly
        raise RuntimeError("the sampler's replay asks other parameters than the stored trials")
    if got.exhausted and len(got.trials) == len(trials):
        s.execute(
            update(Selection)
            .where(Selection.id == sel.id)
            .values(
                error=f"the search ended at {len(trials)} trials: every point of the space has one "
                f"(the sampler asked only points that earlier trials have)"
            )
        )
        s.commit()
        return None
    return got


def _held(s: Session, trial_ids: set[int]) -> bool:
    """Whether a group reservation holds any of these trials (a group of the batch is running or
    about to: it asks its own next trials)."""
    for ids in s.scalars(select(Reservation.trial_ids).where(Reservation.trial_ids.is_not(None))):
        if trial_ids & set(ids or []):
            return True
    return False


def _grow(settings: Settings, *, selection_id: int) -> list[int]:
    with session_for(settings.database_url) as s:
        sel, req, trials = _batch(s, selection_id)
        if sel is None or not trials:
            return []
        if any(t.status not in TRIAL_DONE for t in trials) or _held(s, {t.id for t in trials}):
            return []  # a group runs: it asks its own next trials as its devices free
        got = _replay(s, sel=sel, req=req, trials=trials, upto=None)
        if got is None:
            return []
        queue = s.get(Job, trials[0].job_id).queue
        new = got.trials[len(trials) :]
        base = _owned_base(s, sel=sel, req=req)
        plans = [(len(trials) + i, a.params, apply_params(base, a.params)) for i, a in enumerate(new)]
        try:
            added = add_trials(s, selection_id=selection_id, plans=plans, queue=queue)
        except IntegrityError:
            s.rollback()  # another worker added them first
            return []
        notes = [(t, _note(a.repeats)) for t, a in zip(added, new, strict=True)]
        if any(n for _, n in notes):
            for t, n in notes:
                t.result = n
            s.commit()
        return [t.id for t in added]
