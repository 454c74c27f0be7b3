"""`checkpoints: best` across a whole selection batch.

Each group's executor keeps, as its trials end, only the best ended trial's directory of that group
(trainer/selection/executor.py): a trial that loses inside its group loses in the batch too. A batch
split into groups (`group_size`, several workers) would end with one directory per group; once every
trial has ended, the worker that ends the last group keeps the batch's best trial
(db/selections.py `kept_trial`) and removes every other trial's directory under its data dir, and
their copies in the store (core/storage.py) when the store is not the data dir, before it settles
the batch. Other workers' data dirs are caches: what they hold of a removed trial is never read
again (a restore or a warm start reads the store).
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

from sqlalchemy.orm import Session

from core.settings import Settings
from core.storage import StorageError, get_storage, selection_prefix
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
    if not get_storage(settings).is_data_dir:
        _remove_from_store(settings, selection_id=selection_id, keep=keep)
    if removed:
        log.info(
            "selection %s: kept trial %s's checkpoints, removed %d others", selection_id, keep, len(removed)
        )
    return removed


def _remove_from_store(settings: Settings, *, selection_id: int, keep: int | None) -> list[str]:
    """The store's copies of every trial but `keep`; returns the prefixes removed. A store that
    fails now is logged (the batch still ends: what is left behind is only unreferenced bytes)."""
    storage = get_storage(settings)
    prefix = selection_prefix(selection_id)
    removed = []
    try:
        trials = {k.removeprefix(prefix + "/").split("/", 1)[0] for k in storage.list(prefix)}
        for name in sorted(trials):
            index = name.removeprefix("trial-")
            if name.startswith("trial-") and index.isdigit() and int(index) != keep:
                storage.delete_prefix(f"{prefix}/{name}")
                removed.append(f"{prefix}/{name}")
    except StorageError as e:
        log.warning("selection %s: the other trials' checkpoints stay in the store: %s", selection_id, e)
    if removed:
        log.info("selection %s: removed %s from %s", selection_id, ", ".join(removed), storage.url)
    return removed
