"""Data functions for users and their tokens. A token's secret never reaches the database: callers
pass its SHA-256 (api/auth.py makes secrets and hashes)."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime, timedelta

from sqlalchemy import and_, or_, select, update
from sqlalchemy.exc import IntegrityError, OperationalError
from sqlalchemy.orm import Session

from db.connection import rowcount
from db.jobs import Conflict, NotFound, aware, get_row
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
    return get_row(session, User, user_id, "user")


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
    parent_id: int | None = None,
) -> ApiToken:
    now = utcnow()
    tok = ApiToken(
        user_id=user_id,
        token_hash=token_hash,
        prefix=prefix,
        kind=kind,
        label=label,
        created_at=now,
        expires_at=expires_at,
        parent_id=parent_id,
        last_used_at=now if kind == "session" else None,
    )
    session.add(tok)
    session.commit()
    return tok


_MAX_CHAIN = 64
"""Longest chain of tokens made from tokens that a check follows (a longer one reads as dead)."""


def why_dead(session: Session, tok: ApiToken, *, idle_s: float | None = None) -> str | None:
    """None when `tok` may be used now; else why not (revoked, expired, idle, or a token it was
    made from is). The chain is read up to its root: revoke_token revokes what was made from a
    token, but a session signed in while its token was being revoked may have missed that."""
    now = utcnow()
    what = "session" if tok.kind == "session" else "token"
    if idle_s is not None and tok.kind == "session":
        if aware(tok.last_used_at or tok.created_at) + timedelta(seconds=idle_s) <= now:
            return f"the {what} was idle for more than {idle_s:g} s"
    row: ApiToken | None = tok
    for _ in range(_MAX_CHAIN):
        if row is None:
            return None
        if row.revoked_at is not None:
            return f"the {what} was revoked" if row is tok else f"the {what}'s token was revoked"
        if row.expires_at is not None and aware(row.expires_at) <= now:
            return f"the {what} has expired" if row is tok else f"the {what}'s token has expired"
        row = session.get(ApiToken, row.parent_id) if row.parent_id is not None else None
    return f"the {what} was made from a chain of more than {_MAX_CHAIN} tokens"


def token_by_hash(session: Session, *, token_hash: str, kind: str) -> ApiToken | None:
    return session.scalars(
        select(ApiToken).where(ApiToken.token_hash == token_hash, ApiToken.kind == kind)
    ).first()


def live_token(
    session: Session, *, token_hash: str, kind: str, idle_s: float | None = None
) -> ApiToken | None:
    """The token or session of this hash and kind, if it may be used now."""
    tok = token_by_hash(session, token_hash=token_hash, kind=kind)
    if tok is None or why_dead(session, tok, idle_s=idle_s) is not None:
        return None
    return tok


def user_for_token(session: Session, *, token_hash: str, kind: str) -> User | None:
    """The live token's user: not revoked, not expired (nor any token it was made from)."""
    tok = live_token(session, token_hash=token_hash, kind=kind)
    return tok.user if tok is not None else None


def touch(session: Session, tok: ApiToken, *, every_s: float) -> None:
    """Record a session's use, at most once per `every_s` (not a write per request)."""
    now = utcnow()
    if tok.last_used_at is None or aware(tok.last_used_at) + timedelta(seconds=every_s) <= now:
        try:
            session.execute(update(ApiToken).where(ApiToken.id == tok.id).values(last_used_at=now))
            session.commit()
        except OperationalError:
            # another writer holds the database (SQLite's lock): a read must not fail for this
            # bookkeeping, and the next request writes it
            session.rollback()


def list_tokens(session: Session, *, user_id: int | None = None, sessions: bool = True) -> Sequence[ApiToken]:
    """API tokens (revoked ones too) and, with `sessions`, the sessions not yet ended or expired."""
    live_session = and_(
        ApiToken.kind == "session",
        ApiToken.revoked_at.is_(None),
        or_(ApiToken.expires_at.is_(None), ApiToken.expires_at > utcnow()),
    )
    q = select(ApiToken).where(
        or_(ApiToken.kind == "api", live_session) if sessions else ApiToken.kind == "api"
    )
    if user_id is not None:
        q = q.where(ApiToken.user_id == user_id)
    return session.scalars(q.order_by(ApiToken.id)).all()


def _revoke_descendants(session: Session, ids: list[int], now: datetime) -> None:
    """Everything made from `ids`, level by level (sessions and minted tokens)."""
    frontier = ids
    for _ in range(_MAX_CHAIN):
        if not frontier:
            return
        children = session.scalars(
            select(ApiToken.id).where(ApiToken.parent_id.in_(frontier), ApiToken.revoked_at.is_(None))
        ).all()
        if children:
            session.execute(update(ApiToken).where(ApiToken.id.in_(children)).values(revoked_at=now))
        frontier = list(children)


def revoke_token(session: Session, *, token_id: int, user_id: int | None = None) -> ApiToken:
    """Revoke an API token or end a session, and everything made from it; with `user_id`, only
    one of that user's (another's reads as absent)."""
    tok = session.get(ApiToken, token_id)
    if tok is None or (user_id is not None and tok.user_id != user_id):
        raise NotFound(f"token {token_id} does not exist")
    now = utcnow()
    if tok.revoked_at is None:
        tok.revoked_at = now
    _revoke_descendants(session, [tok.id], now)
    session.commit()
    return tok


def revoke_user_tokens(session: Session, *, user_id: int) -> int:
    """Revoke every token and end every session of a user; how many were live."""
    now = utcnow()
    n = rowcount(
        session.execute(
            update(ApiToken)
            .where(ApiToken.user_id == user_id, ApiToken.revoked_at.is_(None))
            .values(revoked_at=now)
        )
    )
    session.commit()
    return n


def end_session(session: Session, *, token_hash: str) -> None:
    session.execute(
        update(ApiToken)
        .where(ApiToken.token_hash == token_hash, ApiToken.kind == "session")
        .values(revoked_at=utcnow())
    )
    session.commit()
