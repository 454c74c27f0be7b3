"""/api/selections: model-selection batches, their trials and leaderboard, grown or narrowed live."""

from __future__ import annotations

import re
from typing import Annotated, Any

from fastapi import APIRouter, Header, HTTPException, Query, Request, status
from fastapi.responses import StreamingResponse
from pydantic import ValidationError
from sqlalchemy.orm import Session

from api.admission import admission_problem, group_problem, trial_count_problem
from api.auth import CurrentUser, may_see
from api.convert import leaderboard, selection_public, trial_public
from api.deps import PageSize, PageStart, RowId, SessionDep, SettingsDep, StatusFilter
from api.downloads import CHECKPOINT_RESPONSES, BestQuery, FormatQuery, send_checkpoint
from api.downsample import downsample
from api.limits import clip
from api.queue import wake_scheduler
from api.schemas import (
    DB_BIGINT,
    CurvesPublic,
    JobSpec,
    SelectionCreate,
    SelectionPublic,
    SelectionsPublic,
    SelectionStreamEvents,
    Series,
    TrialPublic,
    TrialsAdd,
    sse_doc,
)
from api.selection_stream import selection_events
from api.streams import SseResponse, open_stream
from api.workspaces import WorkspaceRefError, pin_workspace
from core import search
from core.settings import Settings
from db import ingest as db_ingest
from db import jobs as db_jobs
from db import selections as db_sel
from db.models import Selection, User
from jobrules.space import SpaceError, apply_params, sample_params
from jobrules.spec import explain

router = APIRouter(prefix="/api/selections", tags=["selections"])


def _selection_or_404(session: Session, selection_id: int, user: User) -> Selection:
    """Another user's batch reads as absent."""
    try:
        sel = db_sel.get_selection(session, selection_id)
    except db_jobs.NotFound as e:
        raise HTTPException(status.HTTP_404_NOT_FOUND, str(e)) from e
    if not may_see(user, sel.owner_id):
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"selection {selection_id} does not exist")
    return sel


def _trial_specs(
    base: dict[str, Any],
    params: list[dict[str, Any]],
    first: int,
    *,
    session: Session,
    settings: Settings,
    user: User,
    owner_id: int | None,
) -> list[tuple[int, dict, dict]]:
    """Each trial's full spec, validated and pinned like a submitted job: a trial that could never
    run (bad value, too small a budget, indivisible shapes, a workspace that is not the batch
    owner's) refuses the whole request, naming it. `owner_id`: the batch's owner, whose trials
    they are (an admin may add trials to another user's batch)."""
    plans = []
    for i, p in enumerate(params):
        try:
            job = JobSpec.model_validate(apply_params(base, p))
        except SpaceError as e:
            raise HTTPException(status.HTTP_422_UNPROCESSABLE_CONTENT, str(e)) from e
        except ValidationError as e:
            errs = "; ".join(
                f"{'.'.join(str(x) for x in err['loc']) or 'spec'}: {err['msg'].removeprefix('Value error, ')}"
                for err in e.errors()
            )
            raise HTTPException(
                status.HTTP_422_UNPROCESSABLE_CONTENT,
                f"trial {first + i} with params {clip(str(p), 200)} cannot run: {errs}",
            ) from e
        if (reason := admission_problem(session, job, settings=settings, user=user)) is not None:
            raise HTTPException(
                status.HTTP_422_UNPROCESSABLE_CONTENT,
                f"trial {first + i} with params {clip(str(p), 200)} cannot run: {reason}",
            )
        try:
            # the base is pinned already; each trial is checked again as a job is, so a spec that
            # reaches a worker never names a workspace by id or another user's bytes
            spec = pin_workspace(
                session, job.model_dump(), owner_id=owner_id, field=f"trial {first + i}: workspace"
            )
        except WorkspaceRefError as e:
            raise HTTPException(status.HTTP_422_UNPROCESSABLE_CONTENT, str(e)) from e
        plans.append((first + i, p, spec))
    return plans


def _refuse_groups(
    plans: list[tuple[int, dict, dict]],
    req: SelectionCreate,
    *,
    session: Session,
    settings: Settings,
    user: User,
) -> None:
    """A batch whose groups could never be placed is refused, naming `devices` (the scheduler runs
    each group on one worker)."""
    why = group_problem(
        session,
        specs=[spec for _, _, spec in plans],
        devices=req.devices,
        group_size=req.group_size,
        settings=settings,
        user=user,
    )
    if why is not None:
        raise HTTPException(status.HTTP_422_UNPROCESSABLE_CONTENT, why)


def _first_params(body: SelectionCreate) -> tuple[list[dict[str, Any]], list[tuple[int, ...]]]:
    """The trials a batch starts with: the whole grid or random sample, or a sampler's first
    `parallel` trials (the worker asks the next ones as trials end: workers/search.py); with each,
    the earlier trials whose points the sampler asked again first (skipped, core/search.py)."""
    if body.method in ("grid", "random"):
        params = sample_params(body.space, method=body.method, trials=body.trials, seed=body.seed)
        return params, [()] * len(params)
    search.check_fits(body.method, body.space)
    # the same replay the workers run (the request as it is stored), told nothing yet
    got = search.request_plan(body.model_dump(), values=[])
    return [a.params for a in got.trials], [a.repeats for a in got.trials]


@router.post("", status_code=status.HTTP_201_CREATED, response_model=SelectionPublic)
def submit_selection(
    body: SelectionCreate, request: Request, session: SessionDep, settings: SettingsDep, user: CurrentUser
) -> SelectionPublic:
    """The batch's trials are stored queued; the scheduler (core/scheduler.py) places them in
    groups of `group_size`, each group on one worker with room for `devices` slots, so a batch
    spreads over the workers that have room."""
    try:
        base = pin_workspace(session, body.base.model_dump(), field="base.workspace", owner_id=user.id)
    except WorkspaceRefError as e:
        raise HTTPException(status.HTTP_422_UNPROCESSABLE_CONTENT, str(e)) from e
    try:
        params, repeats = _first_params(body)
    except SpaceError as e:
        raise HTTPException(status.HTTP_422_UNPROCESSABLE_CONTENT, f"space: {e}") from e
    count, field = (len(params), "space") if body.method == "grid" else (body.trials or len(params), "trials")
    if (why := trial_count_problem(field=field, has=0, adding=count, settings=settings)) is not None:
        raise HTTPException(status.HTTP_422_UNPROCESSABLE_CONTENT, why)
    plans = _trial_specs(base, params, 0, session=session, settings=settings, user=user, owner_id=user.id)
    _refuse_groups(plans, body, session=session, settings=settings, user=user)
    sel = db_sel.create_selection(
        session,
        name=body.name,
        # stored with the pinned base: added trials and a sampler's later trials (workers/search.py)
        # are made from it, and run the bytes checked now
        request={**body.model_dump(), "base": base},
        metric=body.metric,
        mode=body.mode,
        scheduler=body.scheduler,
        owner_id=user.id,
    )
    trials = db_sel.add_trials(
        session, selection_id=sel.id, plans=plans, queue=body.base.queue, owner_id=user.id, actor=user.name
    )
    if any(repeats):
        for t, r in zip(trials, repeats, strict=True):
            t.result = {"repeats_skipped": list(r)} if r else None
        session.commit()
    wake_scheduler(request)
    return selection_public(db_sel.get_selection(session, sel.id))


@router.get("", response_model=SelectionsPublic)
def list_selections(
    session: SessionDep,
    user: CurrentUser,
    status_: StatusFilter = None,
    owner: str | None = Query(None, max_length=64, description="only this user's batches (admins)"),
    name: str | None = Query(None, max_length=200, description="name contains this (any case)"),
    limit: PageSize = 50,
    offset: PageStart = 0,
) -> SelectionsPublic:
    """Batches the caller may see, newest first, with the count of all that match."""
    rows, total = db_sel.list_selections(
        session,
        owner_id=None if user.is_admin else user.id,
        status=status_,
        owner=owner,
        name=name,
        limit=limit,
        offset=offset,
    )
    return SelectionsPublic(items=[selection_public(s, brief=True) for s in rows], total=total)


@router.get("/{selection_id}", response_model=SelectionPublic)
def get_selection(selection_id: RowId, session: SessionDep, user: CurrentUser) -> SelectionPublic:
    return selection_public(_selection_or_404(session, selection_id, user))


@router.get("/{selection_id}/curves", response_model=CurvesPublic)
def get_curves(
    selection_id: RowId,
    session: SessionDep,
    user: CurrentUser,
    name: str | None = Query(None, max_length=64, description="the metric (default: the batch's)"),
    max_points: int = Query(200, ge=2, le=10_000, description="downsample each trial's curve (LTTB)"),
) -> CurvesPublic:
    """One metric of every trial in one answer: the batch page's curves chart (a request per
    trial was a thousand requests for a batch of 1,000 trials, bench/scale.py)."""
    sel = _selection_or_404(session, selection_id, user)
    metric = name or sel.metric
    jobs = [t.job_id for t in sel.trials if t.job_id is not None]
    raw = db_ingest.series_of_jobs(session, job_ids=jobs, name=metric)
    curves = {}
    for job_id, (steps, values) in raw.items():
        steps, values = downsample(steps, values, max_points=max_points)
        curves[str(job_id)] = Series(steps=steps, values=values)
    return CurvesPublic(selection_id=selection_id, name=metric, curves=curves)


@router.post("/{selection_id}/cancel", response_model=SelectionPublic)
def cancel_selection(selection_id: RowId, session: SessionDep, user: CurrentUser) -> SelectionPublic:
    _selection_or_404(session, selection_id, user)
    try:
        sel = db_sel.cancel_selection(session, selection_id=selection_id)
    except db_jobs.Conflict as e:
        raise HTTPException(status.HTTP_409_CONFLICT, str(e)) from e
    return selection_public(db_sel.get_selection(session, sel.id))


@router.post("/{selection_id}/trials", status_code=status.HTTP_201_CREATED, response_model=SelectionPublic)
def add_trials(
    selection_id: RowId,
    body: TrialsAdd,
    request: Request,
    session: SessionDep,
    settings: SettingsDep,
    user: CurrentUser,
) -> SelectionPublic:
    sel = _selection_or_404(session, selection_id, user)
    if sel.cancel_requested:
        raise HTTPException(
            status.HTTP_409_CONFLICT, f"selection {selection_id} was cancelled; submit a new one"
        )
    try:
        req = SelectionCreate.model_validate(sel.request)
    except ValidationError as e:
        # a request stored by an older version that today's rules refuse: its batch reads, but
        # cannot grow
        raise HTTPException(
            status.HTTP_409_CONFLICT,
            f"selection {selection_id}'s stored request no longer passes today's rules "
            f"({clip(explain(e.errors()), 500)}); submit a new batch",
        ) from e
    if req.method not in ("grid", "random"):
        raise HTTPException(
            status.HTTP_409_CONFLICT,
            f"selection {selection_id} uses method {req.method}: its sampler adds the trials itself, "
            f"as trials end, {req.generation} in flight",
        )
    if body.warm_start_from is not None:
        try:
            db_sel.get_trial(session, selection_id=selection_id, trial_id=body.warm_start_from)
        except db_jobs.NotFound as e:
            raise HTTPException(status.HTTP_422_UNPROCESSABLE_CONTENT, f"warm_start_from: {e}") from e
    first = db_sel.next_trial_index(session, selection_id=selection_id)
    count, field = (len(body.params), "params") if body.params is not None else (body.trials or 0, "trials")
    if (why := trial_count_problem(field=field, has=first, adding=count, settings=settings)) is not None:
        raise HTTPException(status.HTTP_422_UNPROCESSABLE_CONTENT, why)
    if body.params is not None:
        params = body.params
    else:
        # new samples, seeded past the ones already drawn so they differ from the first trials
        try:
            params = sample_params(req.space, method="random", trials=body.trials, seed=req.seed + first)
        except SpaceError as e:
            raise HTTPException(status.HTTP_422_UNPROCESSABLE_CONTENT, f"space: {e}") from e
    unknown = sorted({k for p in params for k in p} - set(req.space) - {"train.steps"})
    if body.params is not None and unknown:
        raise HTTPException(
            status.HTTP_422_UNPROCESSABLE_CONTENT,
            f"params: {unknown} are not dimensions of this batch's space ({sorted(req.space)}) nor train.steps",
        )
    plans = _trial_specs(
        req.base.model_dump(),
        params,
        first,
        session=session,
        settings=settings,
        user=user,
        owner_id=sel.owner_id,
    )
    _refuse_groups(plans, req, session=session, settings=settings, user=user)
    db_sel.add_trials(
        session,
        selection_id=selection_id,
        plans=plans,
        queue=req.base.queue,
        warm_start_from=body.warm_start_from,
        owner_id=sel.owner_id,
        actor=user.name,
    )
    wake_scheduler(request)
    return selection_public(db_sel.get_selection(session, selection_id))


@router.post("/{selection_id}/trials/{trial_id}/stop", response_model=TrialPublic)
def stop_trial(selection_id: RowId, trial_id: RowId, session: SessionDep, user: CurrentUser) -> TrialPublic:
    _selection_or_404(session, selection_id, user)
    try:
        trial = db_sel.request_trial_stop(session, selection_id=selection_id, trial_id=trial_id)
    except db_jobs.NotFound as e:
        raise HTTPException(status.HTTP_404_NOT_FOUND, str(e)) from e
    except db_jobs.Conflict as e:
        raise HTTPException(status.HTTP_409_CONFLICT, str(e)) from e
    return trial_public(trial)


@router.get(
    "/{selection_id}/stream",
    response_class=SseResponse,
    status_code=200,
    responses=sse_doc(SelectionStreamEvents),
)
def stream_selection(
    selection_id: RowId,
    request: Request,
    session: SessionDep,
    settings: SettingsDep,
    user: CurrentUser,
    last_event_id: Annotated[str | None, Header(max_length=40)] = None,
) -> SseResponse:
    """Server-Sent Events: first every trial's state, then `metric` (any trial's point, with
    trial_id and job_id; its id is the resume cursor), live `trial` (a trial changed) and `status`
    (the batch's status). A client that reconnects with Last-Event-ID gets the trials' current
    states and then exactly the points it has not seen."""
    _selection_or_404(session, selection_id, user)
    cursor = last_event_id or request.query_params.get("last_event_id")
    if cursor and any(int(n) > DB_BIGINT for n in re.findall(r"\d+", cursor[:80])):
        raise HTTPException(
            status.HTTP_422_UNPROCESSABLE_CONTENT, f"Last-Event-ID: ids must be <= {DB_BIGINT}"
        )
    # open_stream closes the session: a stream must not hold a pooled connection while it waits
    return open_stream(
        request,
        lambda: selection_events(settings, selection_id=selection_id, last_event_id=cursor),
        session=session,
        user=user,
    )


@router.get("/{selection_id}/checkpoint", response_class=StreamingResponse, responses=CHECKPOINT_RESPONSES)
def download_best_trial(
    selection_id: RowId,
    session: SessionDep,
    settings: SettingsDep,
    user: CurrentUser,
    best: BestQuery = False,
    format: FormatQuery = "pt",  # noqa: A002 - the query parameter's name
) -> StreamingResponse:
    """The batch's best trial's checkpoint (the leaderboard's first: its metric and mode), as
    GET /api/jobs/{id}/checkpoint sends it for that trial's job (`X-Job-Id` names it); `best=true`
    its checkpoint at its best metric step. 404 with the reason while no trial has a metric."""
    sel = _selection_or_404(session, selection_id, user)
    board = leaderboard(sel)
    if not board:
        raise HTTPException(
            status.HTTP_404_NOT_FOUND,
            f"selection {selection_id} has no best trial yet: no trial has reported {sel.metric}",
        )
    trial = next(t for t in sel.trials if t.id == board[0])
    job = db_jobs.get_job(session, trial.job_id)
    return send_checkpoint(session, settings, job, best=best, fmt=format)
