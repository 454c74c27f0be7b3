"""Retention of finished jobs: delete one on request, and a periodic cleanup of those older than
SHARDYARD_JOB_RETENTION_DAYS. Rows go first (one transaction), the job's folder and its objects in
the store (core/storage.py) after: a folder or an object left behind by a failed removal is only
bytes, never a job that half exists."""

from __future__ import annotations

import asyncio
import logging
import shutil
from datetime import timedelta
from pathlib import Path

from starlette.concurrency import run_in_threadpool

from core.settings import Settings
from core.storage import StorageError, get_storage, job_prefix
from db.engine import session_for
from db.models import utcnow
from db.retention import delete_job, delete_jobs, finished_before

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


def cleanup_expired(settings: Settings) -> list[int]:
    """One pass of the retention: every finished job older than the retention, in batches."""
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
