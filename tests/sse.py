"""A small Server-Sent Events reader for the integration tests."""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from typing import Any

import httpx

from shardyard.stream import _parse

TOKENS: dict[str, str] = {}
"""base URL -> the admin token of the stack there (StackHandle fills it), so a stream read from
any test's stack is authenticated without passing the token around."""


def read_sse(
    base_url: str,
    path: str,
    *,
    last_event_id: str | None = None,
    stop_after: int | None = None,
    token: str | None = None,
) -> list[tuple[str | None, str, dict[str, Any]]]:
    """(id, event, data) frames until the server closes the stream (or `stop_after` frames).
    Sent with `token`, by default the admin token of the stack at `base_url`."""
    headers = {"Last-Event-ID": last_event_id} if last_event_id else {}
    token = token or TOKENS.get(base_url) or os.environ.get("SHARDYARD_TOKEN")
    if token:
        headers["Authorization"] = f"Bearer {token}"
    frames: list[tuple[str | None, str, dict[str, Any]]] = []
    with httpx.stream("GET", base_url + path, headers=headers, timeout=httpx.Timeout(10, read=60)) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        for f in sse_frames(r.iter_lines()):
            frames.append(f)
            if stop_after and len(frames) >= stop_after:
                break
    return frames


def sse_frames(lines: Iterable[str]) -> Iterator[tuple[str | None, str, dict[str, Any]]]:
    """(id, event, data) of each frame in a stream's lines, as each one ends: the SDK's parser."""
    for f in _parse(iter(lines), deadline=None):
        yield f.id, f.event, f.data
