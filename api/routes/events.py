"""/api/events: one Server-Sent Events stream of every job's status changes (the live jobs table).

A message on the channel names a job; what the stream sends of it is the job's row, read from the
database and only for a user who may see it. A `deleted` job has no row left: its frame goes out
only for a message the service signed (api/live.py verifies it), since the owner it names is the
message's word alone."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

from fastapi import APIRouter, Request
from sqlalchemy.exc import SQLAlchemyError
from starlette.concurrency import run_in_threadpool

from api.auth import CurrentUser, may_see
from api.convert import job_public
from api.deps import SessionDep, SettingsDep
from api.live import LiveChannel, Wake
from api.schemas import JobsStreamEvents, sse_doc
from api.sse import frame
from api.streams import SseResponse, open_stream
from core.broker import JOBS_CHANNEL, broker_signing_key
from core.settings import Settings
from db.connection import session_for
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
        return job_public(job, brief=True).model_dump(mode="json") if may_see(user, job.owner_id) else None


async def _all_jobs(settings: Settings, user: User) -> AsyncIterator[str]:
    live = LiveChannel(settings.broker_url, JOBS_CHANNEL, signing_key=broker_signing_key(settings))
    try:
        await live.connect()
        yield "retry: 2000\n\n"
        last = time.monotonic()
        while True:
            msg = await live.next(timeout=1.0)
            if live.resubscribed:
                # changes published while the broker was down are gone: have the table reload
                live.resubscribed = False
                yield frame(event="resync", data={})
            # unverified (no signing key): the job it names is a hint of which row to read
            signed = msg is not None and not isinstance(msg, Wake)
            body = msg.hint if isinstance(msg, Wake) else msg
            job_id = body.get("job_id") if body is not None else None
            if isinstance(job_id, int) and not isinstance(job_id, bool):
                try:
                    job = await run_in_threadpool(_job_json, settings, job_id, user)
                except SQLAlchemyError:
                    job = None  # the database is busy; the next change of this job shows it
                if job is not None:
                    last = time.monotonic()
                    yield frame(event="job", data=job)
                elif signed and body.get("status") == "deleted" and may_see(user, body.get("owner_id")):
                    # only its owner and admins learned it existed (a job from before users: admins)
                    yield frame(event="deleted", data={"job_id": job_id})
            elif time.monotonic() - last > settings.sse_keepalive_s:
                last = time.monotonic()
                yield ": keep-alive\n\n"
    finally:
        await live.close()


@router.get("/events", response_class=SseResponse, status_code=200, responses=sse_doc(JobsStreamEvents))
def all_job_events(
    request: Request, session: SessionDep, settings: SettingsDep, user: CurrentUser
) -> SseResponse:
    """Status changes of the jobs the caller may see (an admin: all)."""
    return open_stream(request, lambda: _all_jobs(settings, user), session=session, user=user)
