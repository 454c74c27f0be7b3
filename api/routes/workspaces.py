"""/api/workspaces: upload, list, inspect and delete users' workspaces (.tar.gz or .zip of code and
small data). The archive is checked at upload (core/archive.py: no traversal, links or device
files, bounded unpacked size) and stored content-addressed by its sha256 in the store
(core/storage.py: the data dir by default, or a folder or S3 store every worker reads)."""

from __future__ import annotations

import hashlib
import logging
import os
import tempfile
from pathlib import Path
from typing import Annotated

from fastapi import APIRouter, HTTPException, Query, Request, status
from fastapi import Path as PathParam
from fastapi.concurrency import run_in_threadpool
from sqlalchemy import select
from sqlalchemy.orm import Session

from api.auth import CurrentUser
from api.deps import PageSize, PageStart, SessionDep, SettingsDep
from api.schemas import DB_INT, Name, WorkspacePublic, WorkspacesPublic
from api.workspaces import visible_workspace
from core.archive import ArchiveError, inspect_archive, read_member
from core.settings import Settings
from core.storage import StorageError, get_storage, workspace_key
from db import workspaces as db_ws
from db.connection import session_for
from db.jobs import NotFound, aware
from db.models import TERMINAL, Job, User, Workspace
from jobrules.pyenv import REQUIREMENTS_FILE, requirement_lines, requirement_problems
from jobrules.spec import MAX_PROBLEMS

log = logging.getLogger(__name__)
router = APIRouter(prefix="/api/workspaces", tags=["workspaces"])
MiB = 2**20
MAX_REQUIREMENTS_BYTES = MiB
"""A workspace's requirements.txt is read at upload up to this size (its lines are few and short:
jobrules/pyenv.py MAX_LINES); a larger one is refused."""


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


async def _receive(request: Request, *, settings: Settings) -> tuple[Path, str, int]:
    """Stream the body to a temporary file in this host's workspaces folder (the store's own with
    the default store, so the rename below is the whole store write), hashing as it comes; 413
    past the cap."""
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
    name: Annotated[
        Name, Query(description="a label for the upload: 1-200 characters, some visible")
    ] = "workspace",
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
        await run_in_threadpool(_check_requirements, tmp)
        await run_in_threadpool(_store, settings, tmp, key=workspace_key(digest, info.format))
    finally:
        tmp.unlink(missing_ok=True)
    return await run_in_threadpool(
        _record, settings, digest=digest, size=size, name=name, format=info.format, owner_id=user.id
    )


def _check_requirements(tmp: Path) -> None:
    """422 naming each line of the archive's requirements.txt that the PEP 508 grammar refuses (a
    marker that is not one, above all), as env.pip is checked at submit. The grammar alone: whether
    pip options may be used and which versions the workers run are the worker's to say when it
    installs (an admin's setting and the workers change after an upload)."""
    try:
        raw = read_member(tmp, REQUIREMENTS_FILE, max_bytes=MAX_REQUIREMENTS_BYTES)
    except ArchiveError as e:
        raise HTTPException(status.HTTP_422_UNPROCESSABLE_CONTENT, f"body: {e}") from e
    if raw is None:
        return
    text = raw.decode(errors="replace")  # as the worker reads it
    lines = [(f"{REQUIREMENTS_FILE} line {n}", line) for n, line in requirement_lines(text)]
    if problems := requirement_problems(lines, allow_options=True):
        raise HTTPException(
            status.HTTP_422_UNPROCESSABLE_CONTENT,
            f"body: the workspace's {'; '.join(problems[:MAX_PROBLEMS])}",
        )


def _store(settings: Settings, tmp: Path, *, key: str) -> None:
    """Same bytes, same name: a repeated upload is harmless. A store that cannot be reached answers
    503 with the reason (api/main.py)."""
    storage = get_storage(settings)
    if storage.is_data_dir:
        os.replace(tmp, storage.local_path(key))
    else:
        storage.put_file(key, tmp)


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
    limit: PageSize = 50,
    offset: PageStart = 0,
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
    key = workspace_key(row.digest, row.format)
    if db_ws.delete_workspace(session, workspace_id=workspace_id):
        # the last row of these bytes; a store that fails now leaves only unreferenced bytes
        try:
            get_storage(settings).delete(key)
        except StorageError as e:
            log.warning("workspace %s deleted, but not its archive: %s", workspace_id, e)


def _workspace_or_404(session: Session, ref: str, *, user: User) -> Workspace:
    if not (ref.isdigit() or ref.startswith("sha256:")) or len(ref) > 80:
        raise HTTPException(status.HTTP_422_UNPROCESSABLE_CONTENT, "ref: give an id or sha256:<digest>")
    try:
        return visible_workspace(session, ref, user=user)
    except NotFound as e:
        raise HTTPException(status.HTTP_404_NOT_FOUND, str(e)) from e
