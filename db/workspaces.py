"""Data functions for uploaded workspaces (the archive bytes live in files; see core/settings.py)."""

from __future__ import annotations

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from db.jobs import NotFound
from db.models import Workspace


def add_workspace(
    session: Session, *, digest: str, size: int, name: str, format: str, owner_id: int | None = None
) -> tuple[Workspace, bool]:
    """The owner's row for `digest`, created if new. Returns (row, created): the same user
    uploading the same bytes twice gets the same workspace."""
    row = session.scalar(select(Workspace).where(Workspace.digest == digest, Workspace.owner_id == owner_id))
    if row is not None:
        return row, False
    row = Workspace(digest=digest, size=size, name=name, format=format, owner_id=owner_id)
    session.add(row)
    session.commit()
    return row, True


def list_workspaces(
    session: Session, *, limit: int, offset: int, owner_id: int | None = None
) -> tuple[list[Workspace], int]:
    """Newest first; only `owner_id`'s when given (None: everyone's)."""
    query = select(Workspace)
    if owner_id is not None:
        query = query.where(Workspace.owner_id == owner_id)
    total = session.scalar(select(func.count()).select_from(query.subquery())) or 0
    rows = session.scalars(query.order_by(Workspace.id.desc()).limit(limit).offset(offset)).all()
    return list(rows), total


def get_workspace(session: Session, ref: int | str, *, owner_id: int | None = None) -> Workspace:
    """By id (an int or its digits) or by `sha256:<digest>` (`owner_id`'s row of that digest when
    given, else any: the bytes are the same)."""
    if isinstance(ref, str) and ref.startswith("sha256:"):
        query = select(Workspace).where(Workspace.digest == ref.removeprefix("sha256:"))
        if owner_id is not None:
            query = query.where(Workspace.owner_id == owner_id)
        row = session.scalars(query.order_by(Workspace.id).limit(1)).first()
    else:
        row = session.get(Workspace, int(ref))
    if row is None:
        raise NotFound(f"workspace {ref} not found")
    return row


def owned_workspace(session: Session, ref: int | str, *, owner_id: int | None) -> Workspace:
    """`owner_id`'s own workspace that `ref` names (its id, or `sha256:<digest>`); NotFound when
    that owner has none. Another owner's row never answers, whatever the id or the bytes: a job runs
    only its owner's code (an admin's too). `owner_id` None: rows from before users."""
    query = select(Workspace)
    if isinstance(ref, str) and ref.startswith("sha256:"):
        query = query.where(Workspace.digest == ref.removeprefix("sha256:"))
    else:
        query = query.where(Workspace.id == int(ref))
    owner = Workspace.owner_id.is_(None) if owner_id is None else Workspace.owner_id == owner_id
    row = session.scalars(query.where(owner).order_by(Workspace.id).limit(1)).first()
    if row is None:
        raise NotFound(f"workspace {ref} not found")
    return row


def delete_workspace(session: Session, *, workspace_id: int) -> bool:
    """Delete the row; True when no other row shares its digest (the stored file may go too)."""
    row = get_workspace(session, workspace_id)
    digest = row.digest
    session.delete(row)
    session.commit()
    return session.scalar(select(func.count()).select_from(Workspace).where(Workspace.digest == digest)) == 0
