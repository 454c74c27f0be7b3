"""Data functions for uploaded workspaces (the archive bytes live in files; see core/settings.py)."""

from __future__ import annotations

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from db.jobs import NotFound
from db.models import Workspace


def add_workspace(
    session: Session, *, digest: str, size: int, name: str, format: str, owner_id: int | None = None
) -> tuple[Workspace, bool]:
    """The row for `digest`, created if new. Returns (row, created): uploading the same bytes
    twice gives the same workspace."""
    row = session.scalar(select(Workspace).where(Workspace.digest == digest))
    if row is not None:
        return row, False
    row = Workspace(digest=digest, size=size, name=name, format=format, owner_id=owner_id)
    session.add(row)
    session.commit()
    return row, True


def list_workspaces(
    session: Session, *, owner_id: int | None = None, limit: int, offset: int
) -> tuple[list[Workspace], int]:
    """A page, newest first; `owner_id` keeps one user's."""
    where = [] if owner_id is None else [Workspace.owner_id == owner_id]
    total = session.scalar(select(func.count(Workspace.id)).where(*where)) or 0
    rows = session.scalars(
        select(Workspace).where(*where).order_by(Workspace.id.desc()).limit(limit).offset(offset)
    ).all()
    return list(rows), total


def get_workspace(session: Session, ref: int | str) -> Workspace:
    """By id (an int or its digits) or by `sha256:<digest>`."""
    if isinstance(ref, str) and ref.startswith("sha256:"):
        row = session.scalar(select(Workspace).where(Workspace.digest == ref.removeprefix("sha256:")))
    else:
        row = session.get(Workspace, int(ref))
    if row is None:
        raise NotFound(f"workspace {ref} not found")
    return row


def delete_workspace(session: Session, *, workspace_id: int) -> Workspace:
    row = get_workspace(session, workspace_id)
    session.delete(row)
    session.commit()
    return row
