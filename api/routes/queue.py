"""GET /api/queue: the queued jobs in the scheduler's order, with why each waits."""

from __future__ import annotations

from fastapi import APIRouter

from api.auth import CurrentUser
from api.deps import SessionDep, SettingsDep
from api.queue import queue_entries
from api.schemas import QueuePublic

router = APIRouter(prefix="/api/queue", tags=["queue"])


@router.get("", response_model=QueuePublic)
def get_queue(session: SessionDep, settings: SettingsDep, user: CurrentUser) -> QueuePublic:
    """Admins see every queued job; a user sees their own, each with its place in the whole queue
    (the total counts everyone's)."""
    items, total = queue_entries(session, settings, owner_id=None if user.is_admin else user.id)
    return QueuePublic(items=items, total=total)
