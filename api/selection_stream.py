"""Server-Sent Events for a selection batch: its trials' states, then their live metrics."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from sqlalchemy.exc import SQLAlchemyError
from starlette.concurrency import run_in_threadpool

from api.convert import selection_public
from api.live import LiveChannel
from api.sse import frame
from core.broker import selection_channel
from core.settings import Settings
from db.engine import session_for
from db.models import TERMINAL
from db.selections import get_selection


def _snapshot(settings: Settings, selection_id: int) -> tuple[str, dict[int, int], list[dict[str, Any]]]:
    with session_for(settings.database_url) as s:
        sel = selection_public(get_selection(s, selection_id)).model_dump(mode="json")
    return sel["status"], {t["job_id"]: t["id"] for t in sel["trials"]}, sel["trials"]


async def selection_events(settings: Settings, *, selection_id: int) -> AsyncIterator[str]:
    live = LiveChannel(settings.broker_url, selection_channel(selection_id))
    try:
        await live.connect()
        yield "retry: 2000\n\n"
        status, job_to_trial, trials = await run_in_threadpool(_snapshot, settings, selection_id)
        for t in trials:
            yield frame(event="trial", data=t)
        yield frame(event="status", data={"status": status})
        if status in TERMINAL:
            return
        last = time.monotonic()
        while True:
            body = await live.next(timeout=1.0)
            if live.resubscribed:
                # what was published while the broker was down is gone: send the state again
                live.resubscribed = False
                try:
                    status, job_to_trial, trials = await run_in_threadpool(_snapshot, settings, selection_id)
                except SQLAlchemyError:
                    live.resubscribed = True  # try again on the next round
                else:
                    for t in trials:
                        yield frame(event="trial", data=t)
                    yield frame(event="status", data={"status": status})
                    if status in TERMINAL:
                        return
            if body is None:
                if time.monotonic() - last > settings.sse_keepalive_s:
                    last = time.monotonic()
                    yield ": keep-alive\n\n"
                continue
            last = time.monotonic()
            if body.get("type") == "metrics":
                for p in body["points"]:
                    if p["job_id"] not in job_to_trial:  # a trial added after we connected
                        _, job_to_trial, _ = await run_in_threadpool(_snapshot, settings, selection_id)
                    data = {k: p[k] for k in ("job_id", "step", "name", "value", "time")}
                    yield frame(event="metric", data={"trial_id": job_to_trial.get(p["job_id"]), **data})
            elif body.get("type") == "trial":
                yield frame(event="trial", data=body["trial"])
            elif body.get("type") == "selection":
                yield frame(event="status", data={"status": body["status"]})
                if body["status"] in TERMINAL:
                    return
    finally:
        await live.close()
