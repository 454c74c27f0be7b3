"""Request and response models of users, tokens and sign-in."""

from __future__ import annotations

from datetime import datetime

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


class TokenPublic(BaseModel):
    id: int
    user_id: int
    user: str
    label: str
    prefix: str
    created_at: datetime
    revoked_at: datetime | None


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
