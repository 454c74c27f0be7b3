"""/api/workspaces: upload, list, inspect and delete users' workspaces (.tar.gz or .zip of code and
small data). The archive is checked at upload (core/archive.py: no traversal, links or device
files, bounded unpacked size) and stored content-addressed by its sha256 under the data dir."""

from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path
from typing import Annotated, Any

from fastapi import APIRouter, HTTPException, Query, Request, status
from fastapi import Path as PathParam
from fastapi.concurrency import run_in_threadpool
from sqlalchemy import select
from sqlalchemy.orm import Session

from api.auth import CurrentUser, may_see
from api.deps import SessionDep, SettingsDep
from api.schemas import DB_INT, NO_CONTROLS, WorkspacePublic, WorkspacesPublic
from core.archive import ArchiveError, inspect_archive
from core.settings import Settings
from db import workspaces as db_ws
from db.engine import session_for
from db.jobs import NotFound, aware
from db.models import TERMINAL, Job, User, Workspace

router = APIRouter(prefix="/api/workspaces", tags=["workspaces"])
MiB = 2**20


def workspace_public(row: Workspace) -> WorkspacePublic:
    return WorkspacePublic(
        id=row.id,
        ref=f"sha256:{row.digest}",
        digest=row.digest,
        size=row.size,
        name=row.name,
        format=row.format,
        created_at=aware(row.created_at),
        owner_id=row.owner_id,
    )


def blob_path(settings: Settings, row: Workspace) -> Path:
    return settings.workspaces_dir / f"{row.digest}.{row.format}"


def pin_workspace(
    session: Session, spec: dict[str, Any], *, user: User, field: str = "workspace"
) -> dict[str, Any]:
    """The spec with its workspace reference (an id or a digest) pinned to `sha256:<digest>`, so
    the job runs on exactly the bytes it was submitted with; 422 when `user` has no such workspace."""
    ref = spec.get("workspace")
    if ref is None:
        return spec
    try:
        row = _visible(session, ref, user=user)
    except NotFound as e:
        raise HTTPException(
            status.HTTP_422_UNPROCESSABLE_CONTENT, f"{field}: {e} (upload it with POST /api/workspaces)"
        ) from e
    return {**spec, "workspace": f"sha256:{row.digest}"}


def _visible(session: Session, ref: str, *, user: User) -> Workspace:
    """The workspace `ref` names among those `user` may see (admins: all); NotFound otherwise."""
    if str(ref).isdigit() and int(ref) > DB_INT:  # beyond any id the database holds
        raise NotFound(f"workspace {str(ref)[:20]}... not found")
    row = db_ws.get_workspace(session, ref, owner_id=None if user.is_admin else user.id)
    if not may_see(user, row.owner_id):
        raise NotFound(f"workspace {ref} not found")
    return row


async def _receive(request: Request, *, settings: Settings) -> tuple[Path, str, int]:
    """Stream the body to a temporary file beside the store, hashing as it comes; 413 past the cap."""
    cap = int(settings.workspace_max_mb * MiB)
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > cap:
        raise HTTPException(
            status.HTTP_413_CONTENT_TOO_LARGE,
            f"the workspace archive is {int(declared) / MiB:.1f} MiB; the limit is "
            f"{settings.workspace_max_mb:g} MiB (SHARDYARD_WORKSPACE_MAX_MB)",
        )
    settings.workspaces_dir.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(prefix=".upload.", dir=settings.workspaces_dir)
    digest, size = hashlib.sha256(), 0
    try:
        with os.fdopen(fd, "wb") as f:
            async for chunk in request.stream():
                size += len(chunk)
                if size > cap:
                    raise HTTPException(
                        status.HTTP_413_CONTENT_TOO_LARGE,
                        f"the workspace archive is larger than {settings.workspace_max_mb:g} MiB "
                        f"(SHARDYARD_WORKSPACE_MAX_MB)",
                    )
                digest.update(chunk)
                f.write(chunk)
    except BaseException:
        os.unlink(name)
        raise
    return Path(name), digest.hexdigest(), size


@router.post("", status_code=status.HTTP_201_CREATED, response_model=WorkspacePublic)
async def upload_workspace(
    request: Request,
    settings: SettingsDep,
    user: CurrentUser,
    name: str = Query(
        "workspace", min_length=1, max_length=200, pattern=NO_CONTROLS, description="a label for the upload"
    ),
) -> WorkspacePublic:
    """The body is the archive itself (Content-Type application/gzip, application/zip or
    application/octet-stream); the format is read from its first bytes."""
    tmp, digest, size = await _receive(request, settings=settings)
    try:
        if size == 0:
            raise HTTPException(status.HTTP_422_UNPROCESSABLE_CONTENT, "body: the upload is empty")
        try:
            info = await run_in_threadpool(
                inspect_archive, tmp, max_unpacked=int(settings.workspace_max_unpacked_mb * MiB)
            )
        except ArchiveError as e:
            raise HTTPException(status.HTTP_422_UNPROCESSABLE_CONTENT, f"body: {e}") from e
        final = settings.workspaces_dir / f"{digest}.{info.format}"
        os.replace(tmp, final)  # same bytes, same name: a repeated upload is harmless
    finally:
        tmp.unlink(missing_ok=True)
    return await run_in_threadpool(
        _record, settings, digest=digest, size=size, name=name, format=info.format, owner_id=user.id
    )


def _record(
    settings: Settings, *, digest: str, size: int, name: str, format: str, owner_id: int
) -> WorkspacePublic:
    with session_for(settings.database_url) as session:
        row, _created = db_ws.add_workspace(
            session, digest=digest, size=size, name=name, format=format, owner_id=owner_id
        )
        return workspace_public(row)


@router.get("", response_model=WorkspacesPublic)
def list_workspaces(
    session: SessionDep,
    user: CurrentUser,
    limit: int = Query(50, ge=1, le=500),
    offset: int = Query(0, ge=0, le=DB_INT),
) -> WorkspacesPublic:
    """The caller's workspaces (an admin's: everyone's)."""
    owner = None if user.is_admin else user.id
    rows, total = db_ws.list_workspaces(session, limit=limit, offset=offset, owner_id=owner)
    return WorkspacesPublic(items=[workspace_public(r) for r in rows], total=total)


@router.get("/{ref}", response_model=WorkspacePublic)
def get_workspace(ref: str, session: SessionDep, user: CurrentUser) -> WorkspacePublic:
    return workspace_public(_workspace_or_404(session, ref, user=user))


@router.delete("/{workspace_id}", status_code=status.HTTP_204_NO_CONTENT)
def delete_workspace(
    workspace_id: Annotated[int, PathParam(ge=1, le=DB_INT)],
    session: SessionDep,
    settings: SettingsDep,
    user: CurrentUser,
) -> None:
    row = _workspace_or_404(session, str(workspace_id), user=user)
    ref = f"sha256:{row.digest}"
    live = session.scalars(select(Job.id).where(Job.status.not_in([str(s) for s in TERMINAL]))).all()
    users = [job_id for job_id in live if (session.get(Job, job_id).spec or {}).get("workspace") == ref]
    if users:
        raise HTTPException(
            status.HTTP_409_CONFLICT,
            f"workspace {workspace_id} is used by queued or running job(s) {', '.join(map(str, users))}",
        )
    path = blob_path(settings, row)
    if db_ws.delete_workspace(session, workspace_id=workspace_id):
        path.unlink(missing_ok=True)  # the last row of these bytes


def _workspace_or_404(session: Session, ref: str, *, user: User) -> Workspace:
    if not (ref.isdigit() or ref.startswith("sha256:")) or len(ref) > 80:
        raise HTTPException(status.HTTP_422_UNPROCESSABLE_CONTENT, "ref: give an id or sha256:<digest>")
    try:
        return _visible(session, ref, user=user)
    except NotFound as e:
        raise HTTPException(status.HTTP_404_NOT_FOUND, str(e)) from e
