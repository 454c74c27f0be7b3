"""Data functions for users and their tokens. A token's secret never reaches the database: callers
pass its SHA-256 (api/auth.py makes secrets and hashes)."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime

from sqlalchemy import select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from db.jobs import Conflict, NotFound, aware
from db.models import ApiToken, User, utcnow


def create_user(
    session: Session,
    *,
    name: str,
    is_admin: bool = False,
    max_running_jobs: int | None = None,
    max_ranks: int | None = None,
    max_gpus: int | None = None,
) -> User:
    user = User(
        name=name,
        is_admin=is_admin,
        max_running_jobs=max_running_jobs,
        max_ranks=max_ranks,
        max_gpus=max_gpus,
    )
    session.add(user)
    try:
        session.commit()
    except IntegrityError as e:
        session.rollback()
        raise Conflict(f"a user named {name!r} already exists") from e
    return user


def get_user(session: Session, user_id: int) -> User:
    user = session.get(User, user_id)
    if user is None:
        raise NotFound(f"user {user_id} does not exist")
    return user


def user_by_name(session: Session, name: str) -> User | None:
    return session.scalars(select(User).where(User.name == name)).first()


def list_users(session: Session) -> Sequence[User]:
    return session.scalars(select(User).order_by(User.id)).all()


def add_token(
    session: Session,
    *,
    user_id: int,
    token_hash: str,
    prefix: str,
    kind: str = "api",
    label: str = "",
    expires_at: datetime | None = None,
) -> ApiToken:
    tok = ApiToken(
        user_id=user_id, token_hash=token_hash, prefix=prefix, kind=kind, label=label, expires_at=expires_at
    )
    session.add(tok)
    session.commit()
    return tok


def user_for_token(session: Session, *, token_hash: str, kind: str) -> User | None:
    """The live token's user: not revoked, not expired, of this kind."""
    tok = session.scalars(
        select(ApiToken).where(
            ApiToken.token_hash == token_hash, ApiToken.kind == kind, ApiToken.revoked_at.is_(None)
        )
    ).first()
    if tok is None:
        return None
    if tok.expires_at is not None and aware(tok.expires_at) <= utcnow():
        return None
    return tok.user


def list_tokens(session: Session, *, user_id: int | None = None) -> Sequence[ApiToken]:
    q = select(ApiToken).where(ApiToken.kind == "api")
    if user_id is not None:
        q = q.where(ApiToken.user_id == user_id)
    return session.scalars(q.order_by(ApiToken.id)).all()


def revoke_token(session: Session, *, token_id: int, user_id: int | None = None) -> ApiToken:
    """Revoke an API token; with `user_id`, only one of that user's (another's reads as absent)."""
    tok = session.get(ApiToken, token_id)
    if tok is None or tok.kind != "api" or (user_id is not None and tok.user_id != user_id):
        raise NotFound(f"token {token_id} does not exist")
    if tok.revoked_at is None:
        tok.revoked_at = utcnow()
        session.commit()
    return tok


def end_session(session: Session, *, token_hash: str) -> None:
    session.execute(
        update(ApiToken)
        .where(ApiToken.token_hash == token_hash, ApiToken.kind == "session")
        .values(revoked_at=utcnow())
    )
    session.commit()
