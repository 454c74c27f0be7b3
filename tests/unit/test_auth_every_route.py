"""Every route that asks who is calling refuses a request without a live credential, whatever its
kind: a read, a body-less POST or DELETE, a POST with a JSON body (the request-limit middleware
checks it before reading the body, and the route takes the caller from that check instead of
checking again: api/auth.py `Verified`), an upload, an admin route, a stream. And a cookie
session's POST still needs its CSRF token when the middleware has checked the session.
In-process (TestClient over a migrated SQLite file): no Redis, no worker."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.dependencies.models import Dependant
from fastapi.routing import APIRoute
from fastapi.testclient import TestClient
from pydantic import SecretStr

from api.auth import VERIFIED, current_user
from api.main import create_app
from core.settings import Settings
from db.migrate import upgrade

ADMIN = "admin-token-for-the-every-route-tests"
BODY_METHODS = {"POST", "PUT", "PATCH", "DELETE"}


@pytest.fixture
def client(tmp_path: Path) -> Iterator[TestClient]:
    url = f"sqlite:///{tmp_path / 'api.db'}"
    upgrade(url)
    settings = Settings(
        database_url=url,
        data_dir=tmp_path,
        embedded_scheduler=False,
        admin_token=SecretStr(ADMIN),
        trusted_hosts=["testserver"],
        stall_log_s=0,
        auth_fail_limit=0,  # every made-up token is a 401, not a 429 past the limit
    )
    with TestClient(create_app(settings)) as c:
        yield c


def _asks_for_user(dep: Dependant) -> bool:
    return dep.call is current_user or any(_asks_for_user(d) for d in dep.dependencies)


def _routes(client: TestClient) -> list[tuple[str, str]]:
    """(method, path with every parameter 1) of each route that asks for the caller."""
    found: list[Any] = []
    for route in client.app.routes:  # type: ignore[attr-defined]
        if isinstance(route, APIRoute):
            found.append(route)
        else:  # an included router (FastAPI resolves its routes' effective paths lazily)
            found.extend(getattr(route, "effective_route_contexts", list)())
    out = []
    for route in found:
        if _asks_for_user(route.dependant):
            path = re.sub(r"\{[^}]+\}", "1", route.path)
            out.extend((m, path) for m in sorted(route.methods))
    return out


def _live_token(client: TestClient, *, revoked: bool) -> str:
    admin = {"Authorization": f"Bearer {ADMIN}"}
    me = client.get("/api/auth/me", headers=admin).json()
    uid = me.get("id") or me["user"]["id"]
    made = client.post(f"/api/users/{uid}/tokens", json={"label": "t"}, headers=admin).json()
    if revoked:
        assert client.delete(f"/api/tokens/{made['info']['id']}", headers=admin).status_code == 200
    return str(made["token"])


def test_every_route_kind_refuses_a_request_without_a_live_credential(client: TestClient) -> None:
    routes = _routes(client)
    kinds = {m for m, _ in routes}
    paths = {p for _, p in routes}
    # the kinds this test must cover: reads, bodies, deletes, streams, uploads, admin routes
    assert {"GET", "POST", "DELETE"} <= kinds, kinds
    assert {"/api/jobs/1/stream", "/api/events", "/api/workspaces", "/metrics"} <= paths, paths
    revoked = _live_token(client, revoked=True)
    credentials: list[dict[str, str]] = [
        {},
        {"Authorization": "Bearer sy_made_up"},
        {"Authorization": f"Bearer {revoked}"},
        {"Authorization": "Basic eDp5"},
        {"Cookie": "shardyard_session=sy_not_a_session"},
    ]
    refused = 0
    for method, path in routes:
        for headers in credentials:
            sends: list[dict[str, Any]] = [{}]
            if method in BODY_METHODS:  # without a body, and with one (the middleware's check)
                sends.append({"content": b"{}", "headers": {"Content-Type": "application/json"}})
            for extra in sends:
                h = {**headers, **extra.get("headers", {})}
                resp = client.request(method, path, headers=h, content=extra.get("content"))
                assert resp.status_code == 401, (method, path, headers, resp.status_code, resp.text)
                assert resp.headers["www-authenticate"] == "Bearer"
                refused += 1
    assert refused > 100


def test_a_header_named_like_the_kept_check_is_not_a_credential(client: TestClient) -> None:
    # the check is kept on the request's scope, which only the server writes; a header is a header
    resp = client.post(
        "/api/jobs", content=b"{}", headers={"Content-Type": "application/json", VERIFIED: "1"}
    )
    assert resp.status_code == 401


def test_a_checked_session_still_needs_its_csrf_token(client: TestClient) -> None:
    live = _live_token(client, revoked=False)
    signed = client.post("/api/auth/session", json={"token": live})
    assert signed.status_code == 200, signed.text
    csrf = signed.json()["csrf_token"]
    client.cookies.clear()
    cookie = {"Cookie": f"shardyard_session={signed.cookies['shardyard_session']}"}
    json_body = {"Content-Type": "application/json"}
    # a body: checked by the middleware, then the route's CSRF check on the kept answer
    resp = client.post("/api/users/1/tokens", content=b'{"label": "x"}', headers={**cookie, **json_body})
    assert resp.status_code == 403 and "csrf" in resp.json()["detail"].lower(), resp.text
    resp = client.post(
        "/api/users/1/tokens",
        content=b'{"label": "x"}',
        headers={**cookie, **json_body, "X-CSRF-Token": "0" * 40},
    )
    assert resp.status_code == 403, resp.text
    # with it, the session acts (and cannot mint a token without presenting one: its own rule)
    resp = client.get("/api/auth/me", headers=cookie)
    assert resp.status_code == 200, resp.text
    resp = client.post("/api/jobs/1/cancel", headers={**cookie, "X-CSRF-Token": csrf})
    assert resp.status_code == 404, resp.text  # past the caller's checks: there is no job 1
    resp = client.post("/api/jobs/1/cancel", headers=cookie)
    assert resp.status_code == 403, resp.text
