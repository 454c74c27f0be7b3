"""The workspaces a user may name: resolving a reference (an id or `sha256:<digest>`) among the
ones the user may see, and pinning a submitted spec to the exact bytes. The job and selection
routes pin at submit and the workspace routes look rows up through here, so no route imports
another route's module."""

from __future__ import annotations

from typing import Any

from sqlalchemy.orm import Session

from api.auth import may_see
from api.schemas import DB_INT
from db import workspaces as db_ws
from db.jobs import NotFound
from db.models import User, Workspace


class WorkspaceRefError(ValueError):
    """A spec names a workspace its submitter has no access to; the message names the field."""


def visible_workspace(session: Session, ref: str, *, user: User) -> Workspace:
    """The workspace `ref` names among those `user` may see (admins: all); NotFound otherwise."""
    if str(ref).isdigit() and int(ref) > DB_INT:  # beyond any id the database holds
        raise NotFound(f"workspace {str(ref)[:20]}... not found")
    row = db_ws.get_workspace(session, ref, owner_id=None if user.is_admin else user.id)
    if not may_see(user, row.owner_id):
        raise NotFound(f"workspace {ref} not found")
    return row


def pin_workspace(
    session: Session, spec: dict[str, Any], *, owner_id: int | None, field: str = "workspace"
) -> dict[str, Any]:
    """The spec with its workspace reference pinned to `sha256:<digest>`, so the job runs on
    exactly the bytes it was submitted with. The workspace must be one `owner_id` (the job's owner)
    uploaded, an admin's job too: the worker runs a workspace only for its owner
    (workers/workspace.py), so anything else is refused here rather than failing there.
    WorkspaceRefError names `field` otherwise."""
    ref = spec.get("workspace")
    if ref is None:
        return spec
    try:
        if str(ref).isdigit() and int(ref) > DB_INT:  # beyond any id the database holds
            raise NotFound(f"workspace {str(ref)[:20]}... not found")
        row = db_ws.owned_workspace(session, ref, owner_id=owner_id)
    except NotFound as e:
        raise WorkspaceRefError(
            f"{field}: {e} among the workspaces of the job's owner (a job runs only its owner's "
            f"workspaces; upload it with POST /api/workspaces)"
        ) from e
    return {**spec, "workspace": f"sha256:{row.digest}"}
