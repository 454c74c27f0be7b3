"""The Host check (a guard against DNS rebinding: a page on another site that resolves its own
name to this machine's address reaches the API with its own name as the Host), with an answer that
says which host was refused and which setting lets it in: Starlette's TrustedHostMiddleware says
only "Invalid host header", which leaves someone who opened the dashboard by the machine's name
with nothing to go on."""

from __future__ import annotations

import json
import socket
from collections.abc import Sequence

from starlette.types import ASGIApp, Receive, Scope, Send

SETTING = "SHARDYARD_TRUSTED_HOSTS"


def host_of(header: str) -> str | None:
    """The host part of a Host header, lower case (an IPv6 literal keeps its brackets); None when
    there is none."""
    header = header.strip()
    if header.startswith("["):
        end = header.find("]")
        return header[: end + 1].lower() if end > 0 else None
    host = header.split(":", 1)[0]
    return host.lower() or None


def allowed(host: str, patterns: Sequence[str]) -> bool:
    """`host` is one of `patterns`: a name, `*.example.com` (any name below it), or `*` (any)."""
    for pattern in patterns:
        p = pattern.lower()
        if p == "*" or host == p or (p.startswith("*.") and host.endswith(p[1:])):
            return True
    return False


def own_hostnames() -> list[str]:
    """This machine's own name (what a browser on it, or a tunnel to it, may send as the Host):
    not a name someone else's page can make resolve here, so allowing it keeps the guard."""
    name = socket.gethostname().lower()
    return [name] if name and name not in ("localhost",) else []


class TrustedHosts:
    """Refuse (400) a request whose Host is not one of `allowed_hosts`, naming the host that was
    refused and the setting that allows it; JSON (`detail`) for the API's paths, text elsewhere
    (a browser opening the dashboard)."""

    def __init__(self, app: ASGIApp, allowed_hosts: Sequence[str]) -> None:
        self.app = app
        self.allowed_hosts = [h.lower() for h in allowed_hosts]

    def refusal(self, host: str | None) -> str:
        listed = json.dumps(self.allowed_hosts)
        if host is None:
            return (
                f"the request has no Host header; this API answers only to the hosts in {SETTING} ({listed})"
            )
        shown = host if len(host) <= 100 else host[:100] + "..."
        wanted = json.dumps([*self.allowed_hosts, host])
        return (
            f"host {shown!r} is not one this API answers to: {SETTING} is {listed}. To open it by "
            f"that name, add it to {SETTING} and restart the API (SHARDYARD_TRUSTED_HOSTS='{wanted}'), "
            f"or use one of the names listed"
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        raw = next((v for k, v in scope.get("headers", ()) if k == b"host"), None)
        host = host_of(raw.decode("latin-1")) if raw is not None else None
        if host is not None and allowed(host, self.allowed_hosts):
            await self.app(scope, receive, send)
            return
        if scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008})
            return
        message = self.refusal(host)
        api = str(scope.get("path", "")).startswith("/api/")
        body = json.dumps({"detail": message}).encode() if api else (message + "\n").encode()
        kind = b"application/json" if api else b"text/plain; charset=utf-8"
        headers = [
            (b"content-type", kind),
            (b"content-length", str(len(body)).encode()),
            (b"x-content-type-options", b"nosniff"),  # the refused host is echoed: never as markup
        ]
        await send({"type": "http.response.start", "status": 400, "headers": headers})
        await send({"type": "http.response.body", "body": body})
