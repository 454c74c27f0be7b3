"""Request and response models of users, tokens and sign-in."""

from __future__ import annotations

from datetime import datetime
from typing import Literal

from pydantic import BaseModel, Field

from api.schemas import Name, Strict

UserName = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.@-]+$")
Quota = Field(None, ge=0, le=1_000_000)


class UserCreate(Strict):
    name: str = UserName
    is_admin: bool = False
    max_running_jobs: int | None = Quota
    max_ranks: int | None = Quota
    max_gpus: int | None = Quota


class Quotas(BaseModel):
    running_jobs: int
    ranks: int
    gpus: int


class UserPublic(BaseModel):
    id: int
    name: str
    is_admin: bool
    created_at: datetime
    quotas: Quotas


class UsersPublic(BaseModel):
    items: list[UserPublic]


class TokenCreate(Strict):
    label: Name = "api"
    confirm_token: str | None = Field(
        None,
        min_length=1,
        max_length=200,
        description="one of your live API tokens: required when signed in with a dashboard session "
        "(a session alone cannot mint a token)",
    )


class TokenPublic(BaseModel):
    id: int
    kind: Literal["api", "session"]
    """`session`: a dashboard sign-in (listed while it lasts; DELETE ends it)."""
    user_id: int
    user: str
    label: str
    prefix: str
    parent_id: int | None
    """The token this one was made from: revoking that one revokes this one."""
    created_at: datetime
    expires_at: datetime | None
    last_used_at: datetime | None
    revoked_at: datetime | None


class TokensRevoked(BaseModel):
    revoked: int
    """How many live tokens and sessions were revoked."""


class TokensPublic(BaseModel):
    items: list[TokenPublic]


class TokenIssued(BaseModel):
    """The secret is in this answer only; the server keeps its hash."""

    token: str
    info: TokenPublic


class UserIssued(BaseModel):
    user: UserPublic
    token: str


class SignIn(Strict):
    token: str = Field(min_length=1, max_length=200)


class Me(BaseModel):
    user: UserPublic
    csrf_token: str | None
    """Send it as X-CSRF-Token with every POST and DELETE of a cookie session."""
