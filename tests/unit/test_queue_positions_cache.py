"""api/queue.py: a job listing is answered with queue positions up to STALE_S old while fresher
ones are worked out in a thread of their own (ordering 10,000 queued jobs cost every listing with a
queued job on it 100-150 ms each CACHE_S), but a job newer than the positions held, not in them,
is placed at once; GET /api/queue's own reads stay fresh. Real SQLite."""

from __future__ import annotations

import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from api import queue
from core.settings import Settings
from db.connection import session_for
from db.jobs import create_job
from db.migrate import upgrade

SPEC = {"model": {"kind": "mlp", "layers": 1, "d_model": 16, "seq_len": 8}, "train": {"steps": 9}}


@pytest.fixture
def orders(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """When each ordering of the whole queue ran."""
    seen: list[float] = []
    real = queue.queue_positions

    def counted(session: Any, settings: Settings) -> Any:
        seen.append(time.monotonic())
        return real(session, settings)

    monkeypatch.setattr(queue, "queue_positions", counted)
    monkeypatch.setattr(queue, "CACHE_S", 0.2)
    queue._CACHE.clear()
    return seen


def _job(url: str, name: str) -> tuple[int, float]:
    with session_for(url) as s:
        job = create_job(s, name=name, spec=SPEC)
        return job.id, job.created_at.replace(tzinfo=job.created_at.tzinfo or UTC).timestamp()


def test_listings_take_older_positions_and_refresh_them_in_the_background(
    tmp_path: Path, orders: list[float], monkeypatch: pytest.MonkeyPatch
) -> None:
    url = f"sqlite:///{tmp_path / 'q.db'}"
    upgrade(url)
    settings = Settings(database_url=url, data_dir=tmp_path)
    a, b = _job(url, "a"), _job(url, "b")
    with session_for(url) as s:
        _, where = queue.positions(s, settings, stale_ok=True, need=[a, b])
        assert (where[a[0]], where[b[0]], len(orders)) == (1, 2, 1)  # none held: worked out now
        time.sleep(0.3)  # older than CACHE_S: answered at once, refreshed in the background
        _, where = queue.positions(s, settings, stale_ok=True, need=[a, b])
        assert where[b[0]] == 2
        deadline = time.monotonic() + 10
        while len(orders) < 2 or queue._REFRESHING:  # the background ordering has ended
            assert time.monotonic() < deadline
            time.sleep(0.01)
        # a job submitted after the positions held: placed at once, not left without a position
        c = _job(url, "c")
        _, where = queue.positions(s, settings, stale_ok=True, need=[c])
        assert where[c[0]] == 3 and len(orders) == 3
        # GET /api/queue's reads (no stale_ok) work the order out once CACHE_S has passed
        time.sleep(0.3)
        while queue._REFRESHING:
            time.sleep(0.01)
        before = len(orders)
        queue.positions(s, settings)
        assert len(orders) == before + 1
        # an old job missing from the positions (a reservation holds it) asks for no new order
        # (the positions held stay fresh meanwhile: a stalled test must not make them due)
        monkeypatch.setattr(queue, "CACHE_S", 60)
        old = (10**6, datetime(2020, 1, 1, tzinfo=UTC).timestamp())
        before = len(orders)
        queue.positions(s, settings, stale_ok=True, need=[old])
        assert len(orders) == before
