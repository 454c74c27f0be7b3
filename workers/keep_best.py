"""`checkpoints: best` across a whole selection batch.

Each group's executor keeps, as its trials end, only the best ended trial's directory of that group
(trainer/selection/executor.py): a trial that loses inside its group loses in the batch too. A batch
split into groups (`group_size`, several workers) would end with one directory per group; once every
trial has ended, the worker that ends the last group keeps the batch's best trial
(db/selections.py `kept_trial`) and removes every other trial's directory under its data dir, before
it settles the batch.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

from sqlalchemy.orm import Session

from core.settings import Settings
from db.selections import batch_over, get_selection, kept_trial

log = logging.getLogger(__name__)


def keep_best_checkpoints(settings: Settings, session: Session, *, selection_id: int) -> list[Path]:
    """When every trial of the batch has ended under `checkpoints: best`, remove the checkpoint
    directories of all its trials but the best one; returns the removed directories. Called before
    the batch is settled, so that whoever sees it ended sees one directory; idempotent (two workers
    ending groups at once remove the same ones)."""
    if not batch_over(session, selection_id=selection_id):
        return []
    sel = get_selection(session, selection_id)
    if ((sel.request or {}).get("checkpoints") or "best") != "best":
        return []
    keep = kept_trial(session, selection_id=selection_id)
    root = settings.data_dir / "selections" / str(selection_id)
    removed = []
    for d in sorted(root.glob("trial-*")):
        try:
            index = int(d.name.removeprefix("trial-"))
        except ValueError:
            continue
        if d.is_dir() and index != keep:
            shutil.rmtree(d, ignore_errors=True)
            removed.append(d)
    if removed:
        log.info(
            "selection %s: kept trial %s's checkpoints, removed %d others", selection_id, keep, len(removed)
        )
    return removed
