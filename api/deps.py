"""Typed dependencies for routes."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Annotated

from fastapi import Depends
from sqlalchemy.orm import Session

from core.settings import Settings, get_settings
from db.engine import session_for


def get_session(settings: Annotated[Settings, Depends(get_settings)]) -> Iterator[Session]:
    with session_for(settings.database_url) as session:
        yield session


SettingsDep = Annotated[Settings, Depends(get_settings)]
SessionDep = Annotated[Session, Depends(get_session)]
