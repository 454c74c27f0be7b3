"""Retention of finished jobs: delete one on request, and a periodic cleanup of those (and of ended
selection batches, their trials' jobs with them) older than SHARDYARD_JOB_RETENTION_DAYS. Rows go
first (one transaction), the job's folder and its objects in the store (core/storage.py) after: a
folder or an object left behind by a failed removal is only bytes, never a job that half exists."""

from __future__ import annotations

import asyncio
import logging
import shutil
from datetime import timedelta
from pathlib import Path

from starlette.concurrency import run_in_threadpool

from core.settings import Settings
from core.storage import StorageError, get_storage, job_prefix, selection_prefix
from db.connection import session_for
from db.models import utcnow
from db.retention import (
    delete_job,
    delete_jobs,
    delete_selections,
    finished_before,
    selections_finished_before,
)

log = logging.getLogger(__name__)


def job_folder(settings: Settings, job_id: int) -> Path:
    """Spec, checkpoints and trainer stderr of one job on this host (the worker writes them there;
    with the default store, every host's)."""
    return settings.data_dir / "jobs" / str(job_id)


def _remove_folder(settings: Settings, job_id: int) -> None:
    folder = job_folder(settings, job_id)
    try:
        shutil.rmtree(folder)
    except FileNotFoundError:
        pass
    except OSError as e:
        log.warning("job %s deleted, but its folder %s could not be removed: %s", job_id, folder, e)
    storage = get_storage(settings)
    if not storage.is_data_dir:  # else the folder was the store's copy
        try:
            storage.delete_prefix(job_prefix(job_id))
        except StorageError as e:
            log.warning("job %s deleted, but not its objects in the store: %s", job_id, e)


def delete_finished_job(settings: Settings, *, job_id: int) -> int | None:
    """Delete a finished job with its metrics, events and folder (NotFound, Conflict from db).
    Returns the id of the user who had submitted it."""
    with session_for(settings.database_url) as s:
        owner_id = delete_job(s, job_id=job_id)
    _remove_folder(settings, job_id)
    return owner_id


def _remove_selection_folder(settings: Settings, selection_id: int) -> None:
    """A deleted batch's folder on this host and its objects in the store (its trials' checkpoints)."""
    shutil.rmtree(settings.data_dir / "selections" / str(selection_id), ignore_errors=True)
    storage = get_storage(settings)
    if not storage.is_data_dir:
        try:
            storage.delete_prefix(selection_prefix(selection_id))
        except StorageError as e:
            log.warning("selection %s deleted, but not its objects in the store: %s", selection_id, e)


def cleanup_expired(settings: Settings) -> list[int]:
    """One pass of the retention: every finished job older than the retention, and every ended
    selection batch (its trials' jobs with it), in batches. Returns the ids of the jobs deleted
    (trials' jobs included)."""
    if settings.job_retention_days <= 0:
        return []
    cutoff = utcnow() - timedelta(days=settings.job_retention_days)
    deleted: list[int] = []
    while True:
        with session_for(settings.database_url) as s:
            ids = delete_jobs(s, job_ids=finished_before(s, cutoff=cutoff))
        for job_id in ids:
            _remove_folder(settings, job_id)
        deleted += ids
        if not ids:
            break
    while True:
        with session_for(settings.database_url) as s:
            batches, ids = delete_selections(s, selection_ids=selections_finished_before(s, cutoff=cutoff))
        for job_id in ids:
            _remove_folder(settings, job_id)
        for selection_id in batches:
            _remove_selection_folder(settings, selection_id)
        deleted += ids
        if not batches:
            return deleted


async def retention_loop(settings: Settings) -> None:
    """The API's periodic cleanup (a task of its lifespan); errors wait for the next round."""
    while True:
        try:
            if ids := await run_in_threadpool(cleanup_expired, settings):
                log.info(
                    "retention: deleted %d finished job(s) older than %s days",
                    len(ids),
                    settings.job_retention_days,
                )
        except Exception:  # noqa: BLE001 - a locked or unreachable database: try again next round
            log.exception("retention cleanup failed")
        await asyncio.sleep(settings.retention_check_s)
