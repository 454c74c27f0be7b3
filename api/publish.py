"""What the API itself announces on Redis (a cancelled queued job, a new job), best effort:
the database already holds the change, Redis only makes it show up live."""

from __future__ import annotations

import json
import logging

from core.broker import JOBS_CHANNEL, redis_client
from core.settings import Settings

log = logging.getLogger(__name__)


def publish_job_status(settings: Settings, *, job_id: int, status: str) -> None:
    try:
        redis_client(settings.broker_url).publish(
            JOBS_CHANNEL, json.dumps({"job_id": job_id, "status": status})
        )
    except Exception as e:  # noqa: BLE001 - live updates are best effort
        log.warning("could not publish status of job %s: %s", job_id, e)
