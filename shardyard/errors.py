"""What the SDK raises: one base class, the API's refusals with their status and words, and an API
that could not be reached."""

from __future__ import annotations

from typing import Any

import httpx


class ShardyardError(Exception):
    """Anything the SDK could not do. `status` is the HTTP status when the API answered (None
    when it never did), `message` the API's words (a 422 names each field and its rule)."""

    def __init__(self, message: str, *, status: int | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.status = status

    def __str__(self) -> str:
        return f"{self.status}: {self.message}" if self.status is not None else self.message


class ApiError(ShardyardError):
    """The API refused the request (4xx) or failed it (5xx). `errors` is the 422's list of
    {field, message, type}, one per problem (empty for other statuses)."""

    def __init__(self, message: str, *, status: int, errors: list[dict[str, str]] | None = None) -> None:
        super().__init__(message, status=status)
        self.errors = errors or []

    @property
    def fields(self) -> list[str]:
        """The request fields a 422 names, in its order (`train.lr`, `base.model.layers`, ...)."""
        return [e["field"] for e in self.errors if e.get("field")]


class Unreachable(ShardyardError):
    """No answer from the API: nothing listens at the address (`lost` False), or the connection
    dropped mid-request (`lost` True)."""

    def __init__(self, message: str, *, url: str, lost: bool) -> None:
        super().__init__(message)
        self.url = url
        self.lost = lost


def readable_detail(body: Any, fallback: str) -> tuple[str, list[dict[str, str]]]:
    """(one readable sentence, the per-field problems) from an error body. The API's 422 already
    says "field: rule; field: rule" with `errors` beside it; a bare FastAPI list of {loc, msg} (a
    proxy or an older API) is turned into the same words."""
    if not isinstance(body, dict):
        return fallback, []
    detail = body.get("detail", fallback)
    given = body.get("errors")
    errors: list[Any] = given if isinstance(given, list) else []
    if isinstance(detail, list):
        errors = errors or [
            {
                "field": _field(d.get("loc") or ()),
                "message": str(d.get("msg", "")).removeprefix("Value error, "),
                "type": str(d.get("type", "")),
            }
            for d in detail
            if isinstance(d, dict)
        ]
        detail = "; ".join(f"{e['field']}: {e['message']}" for e in errors) or fallback
    return str(detail), [e for e in errors if isinstance(e, dict)]


def _field(loc: Any) -> str:
    """pydantic's loc without FastAPI's leading part ("body", "query", ...): `train.lr`."""
    parts = [str(x) for x in loc]
    if parts and parts[0] in ("body", "query", "path", "header"):
        parts = parts[1:] or parts
    return ".".join(parts) or "body"


def raise_for(resp: httpx.Response) -> None:
    """ApiError with the API's words for a 4xx/5xx answer; nothing for a success."""
    if resp.status_code < 400:
        return
    try:
        body = resp.json()
    except ValueError:
        body = None
    message, errors = readable_detail(body, resp.text[:2000] or resp.reason_phrase)
    raise ApiError(message, status=resp.status_code, errors=errors)
