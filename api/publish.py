"""What the API itself announces on Redis (a cancelled queued job, a new job), best effort:
the database already holds the change, Redis only makes it show up live. Signed with the service's
key when it has one (core/broker.py), so the API's own streams take the message for what it says."""

from __future__ import annotations

import json
import logging

from core.broker import JOBS_CHANNEL, broker_signing_key, redis_client, sign_live
from core.settings import Settings

log = logging.getLogger(__name__)


def publish_job_status(settings: Settings, *, job_id: int, status: str, owner_id: int | None = None) -> None:
    """`owner_id`: the submitting user, for a job the database no longer has (`deleted`): the
    /api/events streams pass its frame only to that user and to admins."""
    body = {"job_id": job_id, "status": status, **({"owner_id": owner_id} if status == "deleted" else {})}
    payload = json.dumps(body).encode()
    key = broker_signing_key(settings)
    if key is not None:
        payload = sign_live(key, channel=JOBS_CHANNEL, body=payload)
    try:
        redis_client(settings.broker_url).publish(JOBS_CHANNEL, payload)
    except Exception as e:  # noqa: BLE001 - live updates are best effort
        log.warning("could not publish status of job %s: %s", job_id, e)
