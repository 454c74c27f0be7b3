"""/api/users, /api/tokens and /api/auth: accounts, API tokens and the dashboard's sign-in.

Tokens are shown once, in the answer that creates them. Admins create users; everyone manages
their own tokens and sessions; a user's token list and another user's token read as absent to
others. A token minted for oneself belongs to the token it was minted with (revoking that one
revokes it); one an admin mints for another user, and a user's first token, belong to no token.
"""

from __future__ import annotations

from fastapi import APIRouter, HTTPException, Request, Response, status

from api.admission import user_quotas
from api.auth import (
    CSRF_COOKIE,
    SESSION_COOKIE,
    AdminUser,
    Credential,
    CurrentUser,
    check_origin,
    csrf_for,
    hash_secret,
    issue_token,
    token_failure,
)
from api.convert import from_row
from api.deps import RowId, SessionDep, SettingsDep
from api.user_schemas import (
    Me,
    Quotas,
    SignIn,
    TokenCreate,
    TokenIssued,
    TokenPublic,
    TokensPublic,
    TokensRevoked,
    UserCreate,
    UserIssued,
    UserPublic,
    UsersPublic,
)
from core.settings import Settings
from db import users as db_users
from db.jobs import Conflict, NotFound
from db.models import ApiToken, User

router = APIRouter(prefix="/api", tags=["users"])


def user_public(user: User, settings: Settings) -> UserPublic:
    return from_row(UserPublic, user, quotas=Quotas(**user_quotas(user, settings)))


def token_public(tok: ApiToken) -> TokenPublic:
    return from_row(TokenPublic, tok, user=tok.user.name)


def _own_or_404(session: SessionDep, user_id: int, user: User) -> None:
    """404 unless user `user_id` exists and is the caller (or the caller is an admin): another
    user's tokens are not even confirmed to exist."""
    if user_id != user.id and not user.is_admin:
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"user {user_id} does not exist")
    try:
        db_users.get_user(session, user_id)
    except NotFound as e:
        raise HTTPException(status.HTTP_404_NOT_FOUND, str(e)) from e


def _minting_token(request: Request, session: SessionDep, user: User, confirm: str | None) -> int:
    """The API token a new token of `user`'s own is made from: the Bearer token of the request,
    or, from a dashboard session, the token the request re-presents (403 without one)."""
    cred: Credential = request.state.credential
    if cred.kind == "api" and confirm is None:
        return cred.token_id
    if confirm is None:
        raise HTTPException(
            status.HTTP_403_FORBIDDEN,
            "confirm_token: a dashboard session cannot mint a token on its own; send one of your "
            "API tokens as confirm_token",
        )
    tok = db_users.live_token(session, token_hash=hash_secret(confirm.strip()), kind="api")
    if tok is None or tok.user_id != user.id:
        raise token_failure(
            request,
            "confirm_token: not a live API token of yours (unknown or revoked)",
            status_code=status.HTTP_403_FORBIDDEN,
        )
    return tok.id


@router.post("/users", status_code=status.HTTP_201_CREATED, response_model=UserIssued)
def create_user(
    body: UserCreate, session: SessionDep, settings: SettingsDep, _admin: AdminUser
) -> UserIssued:
    try:
        user = db_users.create_user(session, **body.model_dump())
    except Conflict as e:
        raise HTTPException(status.HTTP_409_CONFLICT, str(e)) from e
    secret, _ = issue_token(session, user_id=user.id, label="first")
    return UserIssued(user=user_public(user, settings), token=secret)


@router.get("/users", response_model=UsersPublic)
def list_users(session: SessionDep, settings: SettingsDep, _admin: AdminUser) -> UsersPublic:
    return UsersPublic(items=[user_public(u, settings) for u in db_users.list_users(session)])


@router.post("/users/{user_id}/tokens", status_code=status.HTTP_201_CREATED, response_model=TokenIssued)
def create_token(
    user_id: RowId, body: TokenCreate, request: Request, session: SessionDep, user: CurrentUser
) -> TokenIssued:
    _own_or_404(session, user_id, user)
    parent = _minting_token(request, session, user, body.confirm_token)
    # a token of one's own is made from the caller's token; one an admin hands to another user is
    # that user's own (revoking the admin's token must not lock the other user out)
    secret, row = issue_token(
        session, user_id=user_id, label=body.label, parent_id=parent if user_id == user.id else None
    )
    return TokenIssued(token=secret, info=token_public(row))


@router.delete("/users/{user_id}/tokens", response_model=TokensRevoked)
def revoke_user_tokens(user_id: RowId, session: SessionDep, user: CurrentUser) -> TokensRevoked:
    """Revoke every token and end every session of a user (an admin: anyone's; a user: their
    own, which signs them out everywhere)."""
    _own_or_404(session, user_id, user)
    return TokensRevoked(revoked=db_users.revoke_user_tokens(session, user_id=user_id))


@router.get("/tokens", response_model=TokensPublic)
def list_tokens(session: SessionDep, user: CurrentUser) -> TokensPublic:
    """Your API tokens and live dashboard sessions (an admin: everyone's), without their secrets."""
    rows = db_users.list_tokens(session, user_id=None if user.is_admin else user.id)
    return TokensPublic(items=[token_public(t) for t in rows])


@router.delete("/tokens/{token_id}", response_model=TokenPublic)
def revoke_token(token_id: RowId, session: SessionDep, user: CurrentUser) -> TokenPublic:
    """Revoke a token, or end a session, and with it every session and token made from it."""
    try:
        tok = db_users.revoke_token(session, token_id=token_id, user_id=None if user.is_admin else user.id)
    except NotFound as e:
        raise HTTPException(status.HTTP_404_NOT_FOUND, str(e)) from e
    return token_public(tok)


@router.get("/auth/me", response_model=Me)
def me(request: Request, user: CurrentUser, settings: SettingsDep) -> Me:
    cookie = request.cookies.get(SESSION_COOKIE)
    return Me(user=user_public(user, settings), csrf_token=csrf_for(cookie) if cookie else None)


@router.post("/auth/session", response_model=Me)
def sign_in(
    body: SignIn, request: Request, response: Response, session: SessionDep, settings: SettingsDep
) -> Me:
    """Trade an API token for a dashboard session: an HttpOnly cookie the browser sends with
    every request and EventSource, and the CSRF token to send back with every POST and DELETE."""
    check_origin(request)
    tok = db_users.live_token(session, token_hash=hash_secret(body.token.strip()), kind="api")
    if tok is None:
        raise token_failure(request, "the token is unknown or revoked")
    user = tok.user
    # the session belongs to the token: revoking the token ends it
    secret, _ = issue_token(
        session,
        user_id=user.id,
        kind="session",
        label="dashboard",
        ttl_s=settings.session_ttl_s,
        parent_id=tok.id,
    )
    csrf = csrf_for(secret)
    common = {
        "max_age": int(settings.session_ttl_s),
        "samesite": "strict",
        "secure": settings.cookie_secure,
        "path": "/",
    }
    response.set_cookie(SESSION_COOKIE, secret, httponly=True, **common)
    response.set_cookie(CSRF_COOKIE, csrf, httponly=False, **common)
    return Me(user=user_public(user, settings), csrf_token=csrf)


@router.delete("/auth/session", status_code=status.HTTP_204_NO_CONTENT)
def sign_out(request: Request, response: Response, session: SessionDep, _user: CurrentUser) -> Response:
    cookie = request.cookies.get(SESSION_COOKIE)
    if cookie:
        db_users.end_session(session, token_hash=hash_secret(cookie))
    response = Response(status_code=status.HTTP_204_NO_CONTENT)
    response.delete_cookie(SESSION_COOKIE, path="/")
    response.delete_cookie(CSRF_COOKIE, path="/")
    return response
