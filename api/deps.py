"""Typed dependencies for routes."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Annotated

import anyio
from fastapi import Depends, Path, Query, Request
from sqlalchemy.orm import Session
from starlette.concurrency import run_in_threadpool

from core.settings import Settings, get_settings
from db.connection import session_for
from jobrules.spec import DB_INT


def app_settings(request: Request) -> Settings:
    """The settings the app was made with (api/main.py create_app keeps them in app.state).
    Not a dependency override: with any override set, FastAPI re-reads every dependency's
    signature on every request, which cost each request measurable time (bench/api_load.py)."""
    return getattr(request.app.state, "settings", None) or get_settings()


async def _app_settings(request: Request) -> Settings:
    """app_settings as a dependency. A coroutine: FastAPI runs a plain function dependency in the
    thread pool, and one more hand-over to a thread and back per request is waiting time under
    load (bench/api_load.py) for a lookup that never blocks."""
    return app_settings(request)


async def get_session(settings: Annotated[Settings, Depends(_app_settings)]) -> AsyncIterator[Session]:
    """The request's session. Made here, in the event loop (a session connects on its first query,
    in the route's thread), and closed in a thread (that returns its connection): as a plain
    generator FastAPI handed both ends to the thread pool, one more hand-over per request."""
    session = session_for(settings.database_url)
    try:
        yield session
    finally:
        if not session.in_transaction():
            session.close()  # it holds no connection (committed, or never used): nothing to wait for
        else:
            # shielded: a request cancelled as it ends (its client gone) still gives back its
            # connection
            with anyio.CancelScope(shield=True):
                await run_in_threadpool(session.close)


SettingsDep = Annotated[Settings, Depends(_app_settings)]
SessionDep = Annotated[Session, Depends(get_session)]
RowId = Annotated[int, Path(ge=1, le=DB_INT)]
"""A row's id in a route's path: positive, and within the database's integer (else a 422)."""
PageSize = Annotated[int, Query(ge=1, le=500)]
"""A list route's `limit` (default 50)."""
PageStart = Annotated[int, Query(ge=0, le=DB_INT)]
"""A list route's `offset` (default 0)."""
StatusFilter = Annotated[
    str | None,
    Query(
        alias="status",
        pattern="^(queued|running|succeeded|failed|cancelled)$",
        description="only this status",
    ),
]
"""A list route's `status` filter (jobs, selection batches)."""
