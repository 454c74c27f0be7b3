"""The selection stream (api/selection_stream.py) while the broker is down: it follows the batch
from the database alone, its points, its trials' changes and its end, as the job stream does."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

from sqlalchemy import update

from api.selection_stream import selection_events
from core.settings import Settings
from db import selections as dbs
from db.connection import session_for
from db.models import MetricPoint, Selection, Trial

NO_BROKER = "redis://127.0.0.1:1/0"  # nothing listens there: every subscribe is refused


def _frames(chunks: list[str]) -> list[tuple[str, dict]]:
    out = []
    for chunk in chunks:
        lines = dict(line.split(": ", 1) for line in chunk.strip().splitlines() if not line.startswith(":"))
        if "event" in lines:
            out.append((lines["event"], json.loads(lines["data"])))
    return out


def test_the_stream_follows_the_batch_to_its_end_while_the_broker_is_down(
    db_url: str, tmp_path: Path
) -> None:
    settings = Settings(database_url=db_url, broker_url=NO_BROKER, data_dir=tmp_path)
    with session_for(db_url) as s:
        sel = dbs.create_selection(s, name="b", request={}, metric="loss", mode="min", scheduler="x")
        (trial,) = dbs.add_trials(
            s, selection_id=sel.id, plans=[(0, {}, {"train": {"steps": 4}})], queue="cpu"
        )
        sid, tid, job_id = sel.id, trial.id, trial.job_id
        s.execute(update(Selection).where(Selection.id == sid).values(status="running"))
        s.execute(update(Trial).where(Trial.id == tid).values(status="running"))
        s.commit()

    def end_the_batch() -> None:
        """What the worker writes, with nothing published: a point, the trial's end, the batch's."""
        with session_for(db_url) as s:
            s.add(MetricPoint(job_id=job_id, step=4, name="loss", value=0.5, time=0.0))
            s.execute(update(Trial).where(Trial.id == tid).values(status="succeeded", steps_done=4))
            s.execute(update(Selection).where(Selection.id == sid).values(status="succeeded"))
            s.commit()

    async def read() -> list[str]:
        chunks: list[str] = []
        async for chunk in selection_events(settings, selection_id=sid):
            if chunk.startswith("event: status") and not any(c.startswith("event: status") for c in chunks):
                end_the_batch()  # once the first state is out
            chunks.append(chunk)
        return chunks

    frames = _frames(asyncio.run(asyncio.wait_for(read(), timeout=20)))
    assert frames[0][0] == "trial" and frames[0][1]["status"] == "running"
    assert frames[1] == ("status", {"status": "running"})
    later = frames[2:]
    assert [d["step"] for ev, d in later if ev == "metric"] == [4]
    assert [d["status"] for ev, d in later if ev == "trial"] == ["succeeded"]
    assert later[-1] == ("status", {"status": "succeeded"})
