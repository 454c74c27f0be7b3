"""Request limits that hold before any route runs: body size, content type, and who is asking.

Everything that can refuse a request without its body runs before a byte of the body is read: the
declared size against the cap (413), the content type (415), and the caller's token or session
(401, or 429 past the address's limit of failed token checks: `authenticate`). So an anonymous
client holds no memory of the API's however much it sends: its 95 MB upload is refused on its
headers. Routes open to anonymous callers (the sign-in) read at most `ANONYMOUS_MAX_BYTES`.

A plain HTML form on any web site can POST `text/plain`, `application/x-www-form-urlencoded` or
`multipart/form-data` to this port without a CORS preflight; refusing every non-JSON body closes
that door for good, whatever the route. A JSON body is read at most `max_body_bytes + 1` bytes
far; an upload (`raw_paths`) is not buffered here at all: its route streams it to a temporary
file in chunks and enforces its own cap as they arrive (api/routes/workspaces.py).
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Callable
from typing import Any

from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

BODY_METHODS = frozenset({"POST", "PUT", "PATCH", "DELETE"})
JSON_TYPES = frozenset({"application/json"})
MAX_DETAIL = 300
"""Error messages quote at most this many characters of anything a client sent."""
MAX_JSON_DEPTH = 32
"""No request needs deeper JSON; a deep one would exhaust the recursion of the parser and of every
function that walks the value after it (a 900-deep list gave a 500)."""
_STRINGS = re.compile(rb'"(?:[^"\\]|\\.)*"')
ANONYMOUS_MAX_BYTES = 16 * 1024
"""The largest body a route open to anonymous callers reads (a sign-in is a token of 200
characters at most): many anonymous requests at once still hold only a few MB."""
MAX_INT_DIGITS = sys.get_int_max_str_digits() or 4300
"""Python refuses to parse a longer integer; the JSON parser's error names no field, so the
body is checked first and the field named (`long_number`)."""
_LONG_DIGITS = re.compile(rb"\d{%d}" % (MAX_INT_DIGITS + 1))


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


class _LongNumber(str):
    """An integer literal too long to parse, kept as its text (see `long_number`)."""


def _parse_int(text: str) -> int | _LongNumber:
    return _LongNumber(text) if len(text.lstrip("-")) > MAX_INT_DIGITS else int(text)


def long_number(body: bytes) -> tuple[str, int] | None:
    """(the field, its digits) of the first integer in a JSON body too long for Python to parse,
    or None. Only a body holding such a run of digits is parsed here (in a string it is harmless)."""
    if _LONG_DIGITS.search(body) is None:
        return None
    try:
        value = json.loads(body, parse_int=_parse_int)
    except (ValueError, RecursionError):
        return None  # not JSON: the route's own parse says so
    stack: list[tuple[tuple[Any, ...], Any]] = [((), value)]
    while stack:
        path, v = stack.pop()
        if isinstance(v, _LongNumber):
            return ".".join(str(p) for p in path) or "body", len(v.lstrip("-"))
        if isinstance(v, dict):
            stack.extend(((*path, k), x) for k, x in reversed(v.items()))
        elif isinstance(v, list):
            stack.extend(((*path, i), x) for i, x in reversed(list(enumerate(v))))
    return None


async def _answer(
    send: Send,
    code: int,
    detail: str,
    *,
    extra: dict[str, Any] | None = None,
    more_headers: dict[str, str] | None = None,
) -> None:
    body = json.dumps({"detail": detail, **(extra or {})}).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if code == 401:
        headers.append((b"www-authenticate", b"Bearer"))
    for name, value in (more_headers or {}).items():
        if name.lower() != "www-authenticate" or code != 401:
            headers.append((name.lower().encode("latin-1"), value.encode("latin-1")))
    await send({"type": "http.response.start", "status": code, "headers": headers})
    await send({"type": "http.response.body", "body": body})


Authenticate = Callable[..., HTTPException | None]
"""Called with `scope=` and `headers=` (the request's raw headers): the refusal of a request whose
headers carry no live credential (401, or 429 past its address's limit of failed token checks), or
None (api/auth.py credential_problem)."""


class RequestLimits:
    """413 for a body over `max_body_bytes`; 415 for a body that is not JSON; 401 for a body
    without a live credential, except on `public_paths`. Paths matching one of `raw_paths`
    (uploads) may send other types, up to `max_raw_bytes`, and are passed on unread."""

    def __init__(
        self,
        app: ASGIApp,
        *,
        max_body_bytes: int,
        raw_paths: tuple[str, ...] = (),
        max_raw_bytes: int = 0,
        authenticate: Authenticate | None = None,
        public_paths: tuple[str, ...] = (),
    ) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.raw = re.compile("|".join(raw_paths)) if raw_paths else None
        self.max_raw_bytes = max_raw_bytes
        self.authenticate = authenticate
        self.public = re.compile("|".join(public_paths)) if public_paths else None

    async def _who(self, scope: Scope, headers: dict[bytes, bytes]) -> HTTPException | None:
        if self.authenticate is None:
            return None
        return await run_in_threadpool(self.authenticate, scope=scope, headers=headers)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] not in BODY_METHODS:
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        ctype = headers.get(b"content-type", b"").decode("latin-1").split(";")[0].strip().lower()
        raw = self.raw is not None and self.raw.match(scope["path"]) is not None
        public = self.public is not None and self.public.match(scope["path"]) is not None
        limit = self.max_raw_bytes if raw else self.max_body_bytes
        if public:
            limit = min(limit, ANONYMOUS_MAX_BYTES)
        declared = headers.get(b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > limit):
            await _answer(send, 413, f"request body larger than the limit of {limit} bytes")
            return
        # HTTP/1.1: a request with neither Content-Length nor Transfer-Encoding has no body. A
        # body-less POST (cancel, stop) needs no type; any body must say it is JSON
        has_body = (declared is not None and int(declared) > 0) or b"transfer-encoding" in headers
        if (has_body or ctype) and not raw and ctype not in JSON_TYPES:
            shown = clip(ctype or "none", 80)
            await _answer(send, 415, f"Content-Type must be application/json, got {shown}")
            return
        if not public and (why := await self._who(scope, headers)) is not None:
            await _answer(send, why.status_code, str(why.detail), more_headers=why.headers)
            return
        if raw:
            await self.app(scope, receive, send)
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
        body = b"".join(chunks)
        if (body.count(b"[") + body.count(b"{")) > MAX_JSON_DEPTH:
            if (depth := json_depth(body)) > MAX_JSON_DEPTH:
                await _answer(
                    send, 422, f"body: JSON nested {depth} deep, more than the limit of {MAX_JSON_DEPTH}"
                )
                return
        if (long := long_number(body)) is not None:
            field, digits = long
            message = f"a number of {digits} digits is out of range (at most {MAX_INT_DIGITS} digits)"
            error = {"field": clip(field, 200), "message": message, "type": "int_too_long"}
            await _answer(send, 422, f"{error['field']}: {message}", extra={"errors": [error]})
            return
        sent = False

        async def replay() -> Message:
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)
