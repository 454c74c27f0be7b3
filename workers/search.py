"""Grows a sampler batch (method tpe, cmaes or qmc) by its next generation once the last one has
ended: the worker that ends a group calls `grow` before it settles the batch
(workers/selection.py), and the reconciler calls it for every unsettled batch (workers/tasks.py),
in case a worker died between its group's end and the ask.

The sampler is replayed from the batch's seed and its trials' values in index order
(core/search.py), so whichever worker gets here, and whenever, it asks the same trials. Two workers
that end the generation's last groups at the same moment may both ask: the unique (selection,
index) index lets one add the trials and the other add none. The new trials are queued; the
scheduler (core/scheduler.py) places them in groups like the batch's first ones.
"""

from __future__ import annotations

import logging
from typing import Any

from sqlalchemy import update
from sqlalchemy.exc import IntegrityError, OperationalError

from core.search import SAMPLERS, suggest
from core.settings import Settings
from db.engine import session_for
from db.models import Job, Selection
from db.selections import TRIAL_DONE, add_trials, get_selection
from jobrules.space import apply_params
from jobrules.spec import BatchRules

log = logging.getLogger(__name__)


def grow(settings: Settings, *, selection_id: int) -> list[int]:
    """Add the batch's next generation if it is due; returns the new trial ids. A
    search that cannot go on says why in the selection's `error`, and the batch settles."""
    try:
        return _grow(settings, selection_id=selection_id)
    except OperationalError:  # a locked or unreachable database: the reconciler asks again
        log.warning("selection %d: the database was busy; its next generation waits", selection_id)
        return []
    except Exception as e:  # noqa: BLE001 - the group's own results are in; report, do not lose them
        log.exception("selection %d: the search could not ask its next generation", selection_id)
        _give_up(settings, selection_id=selection_id, reason=f"{type(e).__name__}: {e}")
        return []


def _give_up(settings: Settings, *, selection_id: int, reason: str) -> None:
    with session_for(settings.database_url) as s:
        s.execute(
            update(Selection)
            .where(Selection.id == selection_id)
            .values(error=f"the search stopped before its last generation: {reason}")
        )
        s.commit()


def _grow(settings: Settings, *, selection_id: int) -> list[int]:
    with session_for(settings.database_url) as s:
        sel = get_selection(s, selection_id)
        req: dict[str, Any] = dict(sel.request)
        method, total = req.get("method"), int(req.get("trials") or 0)
        trials = sorted(sel.trials, key=lambda t: t.index)
        if method not in SAMPLERS or sel.cancel_requested or len(trials) >= total:
            return []
        if any(t.status not in TRIAL_DONE for t in trials):
            return []  # the generation is still running
        parallel = int(req.get("parallel") or req.get("devices") or 1)
        rules = BatchRules(**BatchRules.rules_of(req))  # the request's, or its defaults
        if len(trials) % parallel:
            return []  # not a whole generation: the batch was not grown by this sampler
        # a trial's value is its best metric; a failed trial or one without a metric is a failure
        values = [None if t.status == "failed" else t.best_metric for t in trials]
        params = suggest(
            space=req["space"],
            method=method,
            seed=rules.seed,
            mode=rules.mode,
            parallel=parallel,
            values=values,
            total=total,
            startup_trials=req.get("startup_trials"),
        )
        if params[: len(trials)] != [t.params for t in trials]:
            # the replay must ask what was asked: anything else means a different sampler version
            # or a batch edited by hand, and the search cannot go on reproducibly
            raise RuntimeError("the sampler's replay asks other parameters than the stored trials")
        queue = s.get(Job, trials[0].job_id).queue
        plans = [(i, p, apply_params(req["base"], p)) for i, p in enumerate(params) if i >= len(trials)]
        try:
            new = add_trials(s, selection_id=selection_id, plans=plans, queue=queue)
        except IntegrityError:
            s.rollback()  # another worker added this generation first
            return []
        return [t.id for t in new]
