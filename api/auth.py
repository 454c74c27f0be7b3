"""Who is calling: bearer tokens for programs, a cookie session for the dashboard.

- `Authorization: Bearer <token>` on every REST and SSE call (CLI, scripts, tests).
- The dashboard signs in once with a token (POST /api/auth/session) and gets an HttpOnly,
  SameSite=Strict session cookie, which EventSource sends on its own (it cannot set headers).
  A cookie is sent by the browser whatever page started the request, so every unsafe request
  made with the cookie must also carry the session's CSRF token in `X-CSRF-Token`, and an
  `Origin` naming another site is refused outright.

A session belongs to the token it was signed in with: revoking that token (or any token it was
made from) ends the session at once, as it does every token minted with it. A session ends after
`session_ttl_s` whatever happens, and after `session_idle_s` without a request or an open stream.
A session cannot mint a token unless the request re-presents one of the user's API tokens: a
stolen cookie must not become a credential that outlives it.

Bodies wait for the caller: the request-limit middleware (api/limits.py) asks `credential_problem`
before it reads a byte of a body, so an anonymous upload costs the server nothing.

Secrets are 256 random bits; only their SHA-256 is stored. A slow password hash buys nothing for a
secret nobody can guess, and a fast one keeps the per-request lookup cheap.

Guesses are limited all the same (`GuessLimit`): an address whose failed token checks (a Bearer
token, a sign-in, a confirm_token) pass `auth_fail_limit` within `auth_fail_window_s` has each
further failure answered 429 with Retry-After. A live token is always accepted: a guesser sharing
an address with real users (a NAT, a proxy) cannot lock them out.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import math
import os
import secrets
import threading
import time
from collections import OrderedDict, deque
from dataclasses import dataclass
from datetime import timedelta
from typing import Annotated
from urllib.parse import urlsplit

from fastapi import Depends, HTTPException, Request, status
from sqlalchemy.exc import IntegrityError, SQLAlchemyError
from sqlalchemy.orm import Session
from starlette.concurrency import run_in_threadpool
from starlette.requests import HTTPConnection
from starlette.types import Scope

from api.deps import SessionDep, SettingsDep
from core.settings import Settings
from db import users as db_users
from db.connection import session_for
from db.models import ApiToken, User, utcnow

log = logging.getLogger(__name__)

SESSION_COOKIE = "shardyard_session"
CSRF_COOKIE = "shardyard_csrf"
CSRF_HEADER = "x-csrf-token"
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
BOOTSTRAP_LABEL = "SHARDYARD_ADMIN_TOKEN"
ADMIN_VARIABLES = ("SHARDYARD_ADMIN_TOKEN", "SHARDYARD_ADMIN_TOKEN_FILE")
"""The admin token's: the API reads them into its settings at start-up and then drops them from
its environment (`forget_secret_variables`), which every child it starts inherits."""
SECRET_VARIABLES = (*ADMIN_VARIABLES, "SHARDYARD_TOKEN")
"""Credentials `shardyard stack` passes on to none of its processes (SHARDYARD_TOKEN is the CLI's)."""
MAX_ADDRESSES = 10_000
"""Client addresses `GuessLimit` remembers at once: its memory stays bounded whatever the number of
addresses guessing."""


class GuessLimit:
    """Failed token checks per client address over a sliding window. Each address keeps the times of
    its last `limit` failures; a failure when all of them are within the window is refused (429), and
    recorded, so a guesser that keeps on stays refused until it pauses a whole window. Successes are
    neither counted nor refused. One per API process (its own memory): with several API processes
    behind a balancer, an address gets `limit` in each."""

    def __init__(self, *, limit: int, window_s: float) -> None:
        self.limit = limit
        self.window_s = window_s
        self._failures: OrderedDict[str, deque[float]] = OrderedDict()
        self._lock = threading.Lock()  # request threads and the middleware's share it

    def failed(self, address: str) -> int | None:
        """Record a failure from `address`; the seconds until it may fail again without a 429
        (Retry-After) when it is past the limit, else None."""
        if self.limit <= 0:
            return None
        now = time.monotonic()
        with self._lock:
            times = self._failures.pop(address, None) or deque(maxlen=self.limit)
            self._failures[address] = times  # the most recent at the end: the oldest go first
            over = len(times) == self.limit and now - times[0] < self.window_s
            times.append(now)
            while len(self._failures) > MAX_ADDRESSES:
                self._failures.popitem(last=False)
        if not over:
            return None
        return max(1, math.ceil(times[0] + self.window_s - now))


def client_address(scope: Scope) -> str:
    """The caller's address as the server saw it (uvicorn sets it from X-Forwarded-For only for
    the proxies it trusts: FORWARDED_ALLOW_IPS, loopback by default)."""
    client = scope.get("client")
    return str(client[0]) if client else "unknown"


def _guessing(guesses: GuessLimit | None, *, address: str, what: str) -> HTTPException:
    """The refusal of a failed token check: 401 saying `what`, or 429 past the address's limit."""
    if guesses is None or (wait := guesses.failed(address)) is None:
        return _unauthorized(what)
    log.warning("failed token checks from %s past the limit: refused for %d s", address, wait)
    return HTTPException(
        status.HTTP_429_TOO_MANY_REQUESTS,
        f"too many failed token checks from this address (more than {guesses.limit} within "
        f"{guesses.window_s:g} s); try again in {wait} s",
        headers={"Retry-After": str(wait)},
    )


def guess_limit_of(request: Request) -> GuessLimit | None:
    return getattr(request.app.state, "guesses", None)


def new_secret() -> str:
    return "sy_" + secrets.token_urlsafe(32)


def hash_secret(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


def csrf_for(session_secret: str) -> str:
    """The CSRF token is derived from the session secret: another site can neither read the cookie
    nor compute this."""
    return hashlib.sha256(b"csrf:" + session_secret.encode()).hexdigest()[:40]


def issue_token(
    session: Session,
    *,
    user_id: int,
    label: str = "",
    kind: str = "api",
    ttl_s: float | None = None,
    parent_id: int | None = None,
) -> tuple[str, ApiToken]:
    """A new secret and its row; the secret is returned once and never stored. `parent_id`: the
    token it is made from (revoking that one revokes this one)."""
    secret = new_secret()
    expires = utcnow() + timedelta(seconds=ttl_s) if ttl_s else None
    row = db_users.add_token(
        session,
        user_id=user_id,
        token_hash=hash_secret(secret),
        prefix=secret[:8],
        kind=kind,
        label=label,
        expires_at=expires,
        parent_id=parent_id,
    )
    return secret, row


@dataclass(frozen=True, slots=True)
class Credential:
    """What a request signed in with: an API token's or a session's row id. Streams keep it and
    ask again (`credential_problem_by_id`) while they are open."""

    token_id: int
    kind: str


VERIFIED = "shardyard.verified"
"""The scope key of a request's `Verified` credential (api/limits.py RequestLimits writes it)."""


@dataclass(frozen=True, slots=True)
class Verified:
    """A request's credential, found live by the request-limit middleware before it read the body:
    the route takes the caller from here instead of checking the same headers a second time."""

    token_id: int
    kind: str
    user: User
    """Loaded in the middleware's session, detached: the route merges it into its own."""
    cookie: str | None
    """The session secret checked, when the request had no Bearer header (its CSRF token's seed)."""


def _unauthorized(message: str) -> HTTPException:
    return HTTPException(status.HTTP_401_UNAUTHORIZED, message, headers={"WWW-Authenticate": "Bearer"})


def _same_origin(request: Request) -> bool:
    """No Origin (and no Referer) is a non-browser client; otherwise it must name this host."""
    origin = request.headers.get("origin") or request.headers.get("referer")
    if not origin:
        return True
    return urlsplit(origin).netloc == request.headers.get("host", "")


def check_origin(request: Request) -> None:
    if request.method not in SAFE_METHODS and not _same_origin(request):
        raise HTTPException(
            status.HTTP_403_FORBIDDEN, "cross-site request refused: Origin does not match this host"
        )


def _check_csrf(request: Request, session_secret: str) -> None:
    check_origin(request)
    sent = request.headers.get(CSRF_HEADER, "")
    if not hmac.compare_digest(sent.encode(), csrf_for(session_secret).encode()):
        raise HTTPException(
            status.HTTP_403_FORBIDDEN,
            f"missing or wrong {CSRF_HEADER} header: a signed-in browser must send the CSRF token "
            "it got at sign-in with every POST and DELETE",
        )


def _bearer_secret(header: str) -> str:
    scheme, _, secret = header.partition(" ")
    if scheme.lower() != "bearer" or not secret.strip():
        raise _unauthorized("Authorization must be 'Bearer <token>'")
    return secret.strip()


def _touch_every(settings: Settings) -> float:
    # a session's last use is written at most this often: not a write per request, and still
    # a small fraction of the idle limit
    return min(60.0, settings.session_idle_s / 10)


def authenticate(
    session: Session,
    settings: Settings,
    *,
    authorization: str | None,
    cookie: str | None,
    address: str = "unknown",
    guesses: GuessLimit | None = None,
) -> ApiToken:
    """The live token or session the request carries (a Bearer header wins over the cookie);
    401 naming why when there is none, 429 when a Bearer token fails past `address`'s limit
    (`guesses`). A session's use is recorded (its idle expiry)."""
    if authorization is not None:
        tok = db_users.live_token(session, token_hash=hash_secret(_bearer_secret(authorization)), kind="api")
        if tok is None:
            raise _guessing(guesses, address=address, what="the token is unknown or revoked")
        return tok
    if cookie:
        tok = db_users.token_by_hash(session, token_hash=hash_secret(cookie), kind="session")
        why = (
            "no such session"
            if tok is None
            else db_users.why_dead(session, tok, idle_s=settings.session_idle_s)
        )
        if tok is None or why is not None:
            raise _unauthorized(f"the session has ended ({why}); sign in again")
        db_users.touch(session, tok, every_s=_touch_every(settings))
        return tok
    raise _unauthorized("sign in: send 'Authorization: Bearer <token>' (see `shardyard admin create-user`)")


def credential_problem(
    settings: Settings, *, scope: Scope, headers: dict[bytes, bytes], guesses: GuessLimit | None = None
) -> HTTPException | None:
    """The refusal (401, or 429 past the address's limit) of a request whose raw headers carry no
    live credential, or None: the check the request-limit middleware runs before it reads any body
    (its own short session). A credential found live here is kept on the request's scope
    (`Verified`), and the route takes it from there instead of checking the same headers again; a
    failure is counted once: only a request that passes here reaches the route."""
    # read as the route reads them (the first Authorization header, the cookies as Starlette
    # parses them): the answer kept for the route is the one its own check would give
    conn = HTTPConnection(scope)
    authorization = conn.headers.get("authorization")
    cookie = conn.cookies.get(SESSION_COOKIE) if authorization is None else None
    try:
        with session_for(settings.database_url) as s:
            tok = authenticate(
                s,
                settings,
                authorization=authorization,
                cookie=cookie,
                address=client_address(scope),
                guesses=guesses,
            )
            # the user comes with the token (joined); detached, its columns stay loaded
            scope[VERIFIED] = Verified(token_id=tok.id, kind=tok.kind, user=tok.user, cookie=cookie)
    except HTTPException as e:
        return e
    except SQLAlchemyError:
        # the database is locked or away: the route's own check answers 503 with the reason (the
        # app's handlers do not reach a middleware); until then the body stays within its caps
        return None
    return None


def credential_problem_by_id(settings: Settings, cred: Credential) -> str | None:
    """Why the credential a stream was opened with may no longer be used, or None. An open stream
    counts as a session's use (a dashboard left watching a run stays signed in, up to its ttl)."""
    with session_for(settings.database_url) as s:
        tok = s.get(ApiToken, cred.token_id)
        if tok is None:
            return "the token was deleted"
        why = db_users.why_dead(s, tok, idle_s=settings.session_idle_s)
        if why is None and tok.kind == "session":
            db_users.touch(s, tok, every_s=_touch_every(settings))
        return why


def _signed_in(request: Request, session: Session, settings: Settings, cookie: str | None) -> ApiToken:
    tok = authenticate(
        session,
        settings,
        authorization=request.headers.get("authorization"),
        cookie=cookie,
        address=client_address(request.scope),
        guesses=guess_limit_of(request),
    )
    return tok


async def current_user(request: Request, session: SessionDep, settings: SettingsDep) -> User:
    """The caller. A request the request-limit middleware checked (one with a body) carries its
    live credential on its scope (`Verified`: only that middleware writes it, a client cannot): its
    user joins the route's session without a query. Any other request is checked here, in the
    thread pool (a coroutine: a request the middleware checked takes no thread for this)."""
    verified: Verified | None = request.scope.get(VERIFIED)
    if verified is None:
        cookie = request.cookies.get(SESSION_COOKIE)
        tok = await run_in_threadpool(_signed_in, request, session, settings, cookie)
        kind, token_id, user = tok.kind, tok.id, tok.user
    else:
        # the same headers' answer: a Bearer header wins over the cookie there as here
        cookie, kind, token_id = verified.cookie, verified.kind, verified.token_id
        user = session.merge(verified.user, load=False)
    if kind == "session" and request.method not in SAFE_METHODS:
        _check_csrf(request, cookie or "")
    request.state.credential = Credential(token_id=token_id, kind=kind)
    return user


async def admin_user(user: Annotated[User, Depends(current_user)]) -> User:
    # a coroutine: a plain function dependency would cost a hand-over to a thread and back
    if not user.is_admin:
        raise HTTPException(status.HTTP_403_FORBIDDEN, "only an admin may do this")
    return user


CurrentUser = Annotated[User, Depends(current_user)]
AdminUser = Annotated[User, Depends(admin_user)]


def may_see(user: User, owner_id: int | None) -> bool:
    """Users see and act on their own; admins on everything (rows from before users included)."""
    return user.is_admin or owner_id == user.id


def token_failure(
    request: Request, what: str, *, status_code: int = status.HTTP_401_UNAUTHORIZED
) -> HTTPException:
    """A failed token check of a route (a sign-in, a confirm_token): counted against the caller's
    address like a Bearer token's, so each path to the same guess shares one limit. `status_code`:
    the route's own refusal below the limit."""
    refusal = _guessing(guess_limit_of(request), address=client_address(request.scope), what=what)
    if refusal.status_code == status.HTTP_401_UNAUTHORIZED and status_code != refusal.status_code:
        return HTTPException(status_code, what)
    return refusal


def forget_secret_variables() -> None:
    """Take the admin token's variables out of this process's environment once the settings hold
    them: the scheduler child and anything else this process starts inherit it. (The kernel's copy
    of a process's initial environment, /proc/<pid>/environ, cannot be changed: hand a process the
    token in a file, SHARDYARD_ADMIN_TOKEN_FILE, to keep it out of there too.)"""
    for name in ADMIN_VARIABLES:
        os.environ.pop(name, None)


def admin_secret(settings: Settings) -> str | None:
    """The admin token: SHARDYARD_ADMIN_TOKEN, or the contents of SHARDYARD_ADMIN_TOKEN_FILE (read
    each time: `shardyard stack` deletes its file once the API is up)."""
    if settings.admin_token is not None:
        return settings.admin_token.get_secret_value()
    if settings.admin_token_file is None:
        return None
    secret = settings.admin_token_file.read_text().strip()
    if not secret:
        raise ValueError(f"SHARDYARD_ADMIN_TOKEN_FILE: {settings.admin_token_file} is empty")
    return secret


def bootstrap_admin(settings: Settings) -> None:
    """Make the admin token (`admin_secret`) an admin's live token (idempotent; start-up of every
    API process). Tokens from an earlier value of the variable are revoked, so a changed variable
    takes the old secret out of service."""
    secret = admin_secret(settings)
    if secret is None:
        return
    digest = hash_secret(secret)
    with session_for(settings.database_url) as s:
        if db_users.user_for_token(s, token_hash=digest, kind="api") is not None:
            return
        user = db_users.user_by_name(s, settings.admin_name)
        if user is None:
            try:
                user = db_users.create_user(s, name=settings.admin_name, is_admin=True)
            except db_users.Conflict:  # another API process made it just now
                user = db_users.user_by_name(s, settings.admin_name)
        elif not user.is_admin:
            user.is_admin = True
            s.commit()
        for tok in db_users.list_tokens(s, user_id=user.id, sessions=False):
            if tok.label == BOOTSTRAP_LABEL and tok.revoked_at is None:
                db_users.revoke_token(s, token_id=tok.id)
        try:
            db_users.add_token(
                s, user_id=user.id, token_hash=digest, prefix=secret[:8], label=BOOTSTRAP_LABEL
            )
        except IntegrityError:  # a racing API process stored the same token
            s.rollback()
