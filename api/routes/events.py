"""/api/events: one Server-Sent Events stream of every job's status changes (the live jobs table)."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator

import redis.asyncio as aioredis
from fastapi import APIRouter
from fastapi.responses import StreamingResponse
from starlette.concurrency import run_in_threadpool

from api.auth import CurrentUser, may_see
from api.convert import job_public
from api.deps import SettingsDep
from api.sse import frame
from core.broker import JOBS_CHANNEL
from core.settings import Settings
from db.engine import session_for
from db.jobs import NotFound, get_job
from db.models import User

router = APIRouter(prefix="/api", tags=["events"])


def _job_json(settings: Settings, job_id: int, user: User) -> dict | None:
    """The job as the jobs table shows it; None when it is gone or not the user's to see."""
    with session_for(settings.database_url) as s:
        try:
            job = get_job(s, job_id)
        except NotFound:
            return None
        return job_public(job).model_dump(mode="json") if may_see(user, job.owner_id) else None


async def _all_jobs(settings: Settings, user: User) -> AsyncIterator[str]:
    client = aioredis.Redis.from_url(settings.broker_url)
    pubsub = client.pubsub()
    try:
        await pubsub.subscribe(JOBS_CHANNEL)
        yield "retry: 2000\n\n"
        last = time.monotonic()
        while True:
            msg = await pubsub.get_message(ignore_subscribe_messages=True, timeout=1.0)
            if msg is not None:
                job = await run_in_threadpool(_job_json, settings, json.loads(msg["data"])["job_id"], user)
                if job is not None:
                    last = time.monotonic()
                    yield frame(event="job", data=job)
            elif time.monotonic() - last > settings.sse_keepalive_s:
                last = time.monotonic()
                yield ": keep-alive\n\n"
    finally:
        await pubsub.aclose()
        await client.aclose()


@router.get("/events")
def all_job_events(settings: SettingsDep, user: CurrentUser) -> StreamingResponse:
    """Status changes of the jobs the caller may see (an admin: all)."""
    return StreamingResponse(
        _all_jobs(settings, user), media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
    )
