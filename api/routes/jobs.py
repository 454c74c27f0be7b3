"""/api/jobs: submit, list, inspect, cancel, metrics, logs, live stream."""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from typing import Annotated

from fastapi import APIRouter, BackgroundTasks, Header, HTTPException, Path, Query, Request, status
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, Field

from api.admission import admission_problem
from api.auth import AdminUser, CurrentUser, may_see
from api.checkpoints import CheckpointPublic, find_checkpoint, open_download
from api.convert import event_public, job_public
from api.deps import PageSize, PageStart, SessionDep, SettingsDep, StatusFilter
from api.downloads import CHECKPOINT_RESPONSES, BestQuery, FormatQuery, checkpoint_errors, send_checkpoint
from api.publish import publish_job_status
from api.queue import wake_scheduler, with_placement
from api.retention import delete_finished_job
from api.schemas import (
    DB_BIGINT,
    DB_INT,
    EventsPublic,
    JobPublic,
    JobSpec,
    JobsPublic,
    JobStreamEvents,
    MetricsPublic,
    Series,
    TimelinePublic,
    sse_doc,
)
from api.series import job_series
from api.sse import MAX_CURSOR, job_events
from api.streams import SseResponse, open_stream
from api.workspaces import WorkspaceRefError, pin_workspace
from db import ingest as db_ingest
from db import jobs as db_jobs
from db import selections as db_sel
from db.models import Job, User

router = APIRouter(prefix="/api/jobs", tags=["jobs"])

JobId = Annotated[int, Path(ge=1, le=DB_INT, description="a job's id")]


@contextlib.contextmanager
def _as_http() -> Iterator[None]:
    """The data layer's NotFound and Conflict as the 404 and 409 every route answers with."""
    try:
        yield
    except db_jobs.NotFound as e:
        raise HTTPException(status.HTTP_404_NOT_FOUND, str(e)) from e
    except db_jobs.Conflict as e:
        raise HTTPException(status.HTTP_409_CONFLICT, str(e)) from e


def _job_or_404(session: SessionDep, job_id: int, user: User) -> Job:
    """Another user's job reads as absent: its existence is not theirs to learn."""
    try:
        job = db_jobs.get_job(session, job_id)
    except db_jobs.NotFound as e:
        raise HTTPException(status.HTTP_404_NOT_FOUND, str(e)) from e
    if not may_see(user, job.owner_id):
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"job {job_id} does not exist")
    return job


@router.post("", status_code=status.HTTP_201_CREATED, response_model=JobPublic)
def submit_job(
    spec: JobSpec,
    request: Request,
    background: BackgroundTasks,
    session: SessionDep,
    settings: SettingsDep,
    user: CurrentUser,
) -> JobPublic:
    if (reason := admission_problem(session, spec, settings=settings, user=user)) is not None:
        raise HTTPException(status.HTTP_422_UNPROCESSABLE_CONTENT, reason)
    try:
        pinned = pin_workspace(session, spec.model_dump(), owner_id=user.id)
    except WorkspaceRefError as e:
        raise HTTPException(status.HTTP_422_UNPROCESSABLE_CONTENT, str(e)) from e
    job = db_jobs.create_job(
        session,
        name=spec.name,
        spec=pinned,
        priority=spec.priority,
        queue=spec.queue,
        world_size=spec.parallel.world_size,
        steps=spec.train.steps,
        owner_id=user.id,
        actor=user.name,
    )
    # the scheduler places it (core/scheduler.py) and sends its task; wake it now
    wake_scheduler(request)
    # the row is committed; the live announcement (a Redis round trip) goes out after the answer
    background.add_task(publish_job_status, settings, job_id=job.id, status="queued")
    return job_public(job)


@router.get("", response_model=JobsPublic)
def list_jobs(
    session: SessionDep,
    settings: SettingsDep,
    user: CurrentUser,
    status_: StatusFilter = None,
    owner: str | None = Query(None, max_length=64, description="only this user's jobs (admins)"),
    name: str | None = Query(None, max_length=200, description="name contains this (any case)"),
    limit: PageSize = 50,
    offset: PageStart = 0,
) -> JobsPublic:
    rows, total = db_jobs.list_jobs(
        session,
        status=status_,
        owner_id=None if user.is_admin else user.id,
        owner=owner,
        name=name,
        limit=limit,
        offset=offset,
    )
    items = [job_public(j, brief=True) for j in rows]
    with_placement(session, settings, list(rows), items)
    return JobsPublic(items=items, total=total)


@router.get("/{job_id}", response_model=JobPublic)
def get_job(job_id: JobId, session: SessionDep, settings: SettingsDep, user: CurrentUser) -> JobPublic:
    job = _job_or_404(session, job_id, user)
    out = job_public(job)
    with_placement(session, settings, [job], [out])
    return out


@router.post("/{job_id}/cancel", response_model=JobPublic)
def cancel_job(job_id: JobId, session: SessionDep, settings: SettingsDep, user: CurrentUser) -> JobPublic:
    _job_or_404(session, job_id, user)
    with _as_http():
        job = db_jobs.request_cancel(session, job_id=job_id, actor=user.name)
    if job.status == "cancelled":
        publish_job_status(settings, job_id=job.id, status="cancelled")
    return job_public(job)


class OperatorAction(BaseModel):
    reason: str = Field("", max_length=2000, description="why, kept in the job's log")


def _after_operator(session: SessionDep, settings: SettingsDep, job: Job) -> JobPublic:
    """A trial's batch follows its trial; a re-queued job or trial waits for the scheduler (a
    trial runs again in a group of its batch)."""
    if job.kind == "trial" and job.selection_id is not None:
        db_sel.sync_trials(session, job_ids=[job.id])
        db_sel.settle_selection(session, selection_id=job.selection_id)
    publish_job_status(settings, job_id=job.id, status=job.status)
    session.refresh(job)
    return job_public(job)


@router.post("/{job_id}/fail", response_model=JobPublic)
def fail_job(
    job_id: JobId,
    session: SessionDep,
    settings: SettingsDep,
    admin: AdminUser,
    body: OperatorAction | None = None,
) -> JobPublic:
    """An admin ends a queued or running job `failed`; a running attempt is fenced off (its
    worker kills the trainer at its next batch)."""
    reason = (body.reason if body else "") or f"failed by {admin.name}"
    with _as_http():
        job = db_jobs.fail_job(session, job_id=job_id, reason=reason, actor=admin.name)
    return _after_operator(session, settings, job)


@router.post("/{job_id}/requeue", response_model=JobPublic)
def requeue_job(
    job_id: JobId,
    session: SessionDep,
    settings: SettingsDep,
    admin: AdminUser,
    body: OperatorAction | None = None,
) -> JobPublic:
    """An admin puts a running or ended job back in the queue; it resumes from its latest
    checkpoint. A running attempt is fenced off."""
    reason = (body.reason if body else "") or f"re-queued by {admin.name}"
    with _as_http():
        job = db_jobs.requeue_job(session, job_id=job_id, reason=reason, actor=admin.name)
    return _after_operator(session, settings, job)


@router.delete("/{job_id}", status_code=status.HTTP_204_NO_CONTENT)
def delete_job(job_id: JobId, settings: SettingsDep, _admin: AdminUser) -> None:
    """(admin) A finished job with its metrics, events and folder (checkpoints, spec, stderr)."""
    with _as_http():
        owner_id = delete_finished_job(settings, job_id=job_id)
    publish_job_status(settings, job_id=job_id, status="deleted", owner_id=owner_id)


@router.get("/{job_id}/metrics", response_model=MetricsPublic)
def get_metrics(
    job_id: JobId,
    session: SessionDep,
    settings: SettingsDep,
    user: CurrentUser,
    names: str | None = Query(None, max_length=2000, description="comma-separated metric names"),
    since_step: int = Query(0, ge=0, le=DB_INT),
    max_points: int | None = Query(None, ge=2, le=100_000, description="downsample each series (LTTB)"),
) -> MetricsPublic:
    job = _job_or_404(session, job_id, user)
    wanted = [n.strip() for n in names.split(",") if n.strip()] if names else None
    raw = job_series(
        session,
        database_url=settings.database_url,
        job=job,
        names=wanted,
        since_step=since_step,
        max_points=max_points,
    )
    series = {name: Series(steps=steps, values=values) for name, (steps, values) in raw.items()}
    return MetricsPublic(job_id=job_id, series=series)


@router.get(
    "/{job_id}/checkpoint/info",
    response_model=CheckpointPublic,
    responses={
        404: {"description": "no such job of yours, or it has no whole checkpoint (the reason)"},
        503: {"description": "the store did not answer (the reason)"},
    },
)
def checkpoint_info(
    job_id: JobId,
    session: SessionDep,
    settings: SettingsDep,
    user: CurrentUser,
    best: BestQuery = False,
    format: FormatQuery = "pt",  # noqa: A002 - the query parameter's name
) -> CheckpointPublic:
    """What `GET /api/jobs/{id}/checkpoint` would send now (its step, size and filename), or why
    there is nothing to send (404): the job page's download link."""
    job = _job_or_404(session, job_id, user)
    with checkpoint_errors(job_id):
        found = find_checkpoint(settings, session, job, best=best)
        info = found.public(job_id)
        if format == "safetensors":
            got = open_download(settings, found, job_id=job_id, fmt=format, stream=False)
            info = info.model_copy(update={"size": got.size, "filename": got.filename, "format": format})
        return info


@router.get("/{job_id}/checkpoint", response_class=StreamingResponse, responses=CHECKPOINT_RESPONSES)
def download_checkpoint(
    job_id: JobId,
    session: SessionDep,
    settings: SettingsDep,
    user: CurrentUser,
    best: BestQuery = False,
    format: FormatQuery = "pt",  # noqa: A002 - the query parameter's name
) -> StreamingResponse:
    """The job's trained weights: its newest whole checkpoint in the store (api/checkpoints.py), or
    with `best=true` the one at its best metric step, streamed as a file that
    `torch.load(path, weights_only=True)` reads; `format=safetensors` sends the model's weights
    alone as a safetensors file (`safetensors.torch.load_file`). A selection trial's job serves
    its trial's checkpoint (GET /api/selections/{id}/checkpoint: the batch's best trial's)."""
    job = _job_or_404(session, job_id, user)
    return send_checkpoint(session, settings, job, best=best, fmt=format)


@router.get("/{job_id}/logs", response_model=EventsPublic)
def get_logs(
    job_id: JobId,
    session: SessionDep,
    user: CurrentUser,
    after_id: int = Query(0, ge=0, le=DB_BIGINT),
    limit: int = Query(1000, ge=1, le=10_000),
) -> EventsPublic:
    _job_or_404(session, job_id, user)
    rows = db_ingest.events_after(
        session, job_id=job_id, after_id=after_id, kinds=("log", "status"), limit=limit
    )
    return EventsPublic(items=[event_public(e) for e in rows])


@router.get("/{job_id}/timeline", response_model=TimelinePublic, response_model_exclude_unset=True)
def get_timeline(job_id: JobId, session: SessionDep, user: CurrentUser) -> dict:
    """The pipeline's executed and simulated per-rank timelines (404 until the trainer sent one)."""
    _job_or_404(session, job_id, user)
    ev = db_ingest.latest_event(session, job_id=job_id, message="timeline")
    if ev is None or ev.data is None:
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"job {job_id} has no pipeline timeline yet")
    return ev.data


@router.get(
    "/{job_id}/stream", response_class=SseResponse, status_code=200, responses=sse_doc(JobStreamEvents)
)
def stream_job(
    job_id: JobId,
    request: Request,
    session: SessionDep,
    settings: SettingsDep,
    user: CurrentUser,
    last_event_id: Annotated[str | None, Header(max_length=MAX_CURSOR)] = None,
) -> SseResponse:
    _job_or_404(session, job_id, user)
    cursor = last_event_id or request.query_params.get("last_event_id")
    if cursor and len(cursor) > MAX_CURSOR:
        raise HTTPException(
            status.HTTP_422_UNPROCESSABLE_CONTENT, f"Last-Event-ID: at most {MAX_CURSOR} characters"
        )
    if cursor and any(int(n) > DB_BIGINT for n in re.findall(r"\d+", cursor)):
        raise HTTPException(
            status.HTTP_422_UNPROCESSABLE_CONTENT, f"Last-Event-ID: ids must be <= {DB_BIGINT}"
        )
    # open_stream closes the session: a stream that held a pooled connection while it waits would
    # starve every other request once the pool's worth of streams is open
    return open_stream(
        request,
        lambda: job_events(settings, job_id=job_id, last_event_id=cursor),
        session=session,
        user=user,
    )
