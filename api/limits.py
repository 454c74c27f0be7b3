"""Request limits that hold before any route runs: body size and content type.

A plain HTML form on any web site can POST `text/plain`, `application/x-www-form-urlencoded` or
`multipart/form-data` to this port without a CORS preflight; refusing every non-JSON body closes
that door for good, whatever the route. A body is read at most `max_body_bytes + 1` bytes far, so a
huge upload costs the server nothing.
"""

from __future__ import annotations

import json
import re

from starlette.types import ASGIApp, Message, Receive, Scope, Send

BODY_METHODS = frozenset({"POST", "PUT", "PATCH", "DELETE"})
JSON_TYPES = frozenset({"application/json"})
MAX_DETAIL = 300
"""Error messages quote at most this many characters of anything a client sent."""
MAX_JSON_DEPTH = 32
"""No request needs deeper JSON; a deep one would exhaust the recursion of the parser and of every
function that walks the value after it (a 900-deep list gave a 500)."""
_STRINGS = re.compile(rb'"(?:[^"\\]|\\.)*"')


def json_depth(body: bytes) -> int:
    """Nesting depth of a JSON text without parsing it (strings are skipped: brackets in them do
    not count). Linear in the body and recursion-free."""
    depth = deepest = 0
    for ch in _STRINGS.sub(b"", body):
        if ch in b"[{":
            depth += 1
            deepest = max(deepest, depth)
        elif ch in b"]}":
            depth -= 1
    return deepest


def clip(text: str, limit: int = MAX_DETAIL) -> str:
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


async def _answer(send: Send, code: int, detail: str) -> None:
    body = json.dumps({"detail": detail}).encode()
    await send(
        {
            "type": "http.response.start",
            "status": code,
            "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
        }
    )
    await send({"type": "http.response.body", "body": body})


class RequestLimits:
    """413 for a body over `max_body_bytes`; 415 for a body that is not JSON. Paths matching one
    of `raw_paths` (uploads) may send other types, up to `max_raw_bytes`."""

    def __init__(
        self,
        app: ASGIApp,
        *,
        max_body_bytes: int,
        raw_paths: tuple[str, ...] = (),
        max_raw_bytes: int = 0,
    ) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.raw = re.compile("|".join(raw_paths)) if raw_paths else None
        self.max_raw_bytes = max_raw_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] not in BODY_METHODS:
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        ctype = headers.get(b"content-type", b"").decode("latin-1").split(";")[0].strip().lower()
        raw = self.raw is not None and self.raw.match(scope["path"]) is not None
        limit = self.max_raw_bytes if raw else self.max_body_bytes
        declared = headers.get(b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > limit):
            await _answer(send, 413, f"request body larger than the limit of {limit} bytes")
            return
        chunks: list[bytes] = []
        size = 0
        more = True
        while more:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                return
            chunk = msg.get("body", b"")
            size += len(chunk)
            if size > limit:
                await _answer(send, 413, f"request body larger than the limit of {limit} bytes")
                return
            chunks.append(chunk)
            more = msg.get("more_body", False)
        # a body-less POST (cancel, stop) needs no type; any body must say it is JSON
        if (size or ctype) and not raw and ctype not in JSON_TYPES:
            shown = clip(ctype or "none", 80)
            await _answer(send, 415, f"Content-Type must be application/json, got {shown}")
            return
        body = b"".join(chunks)
        if not raw and (body.count(b"[") + body.count(b"{")) > MAX_JSON_DEPTH:
            if (depth := json_depth(body)) > MAX_JSON_DEPTH:
                await _answer(
                    send, 422, f"body: JSON nested {depth} deep, more than the limit of {MAX_JSON_DEPTH}"
                )
                return
        sent = False

        async def replay() -> Message:
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)
