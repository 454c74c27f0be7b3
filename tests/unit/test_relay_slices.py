"""A big backlog goes into the database in slices, each its own transaction, so the relay never
holds SQLite's one write lock for long (a submit waiting behind a fast job's flush answered
150-250 ms late: bench.api_load). A real Relay over a real database (SQLite and PostgreSQL): every
line lands once, in several commits; a database error in a later slice keeps the slices already
committed and applies the rest, once, on the next flush."""

from __future__ import annotations

import json
import time

import pytest
from sqlalchemy import event
from sqlalchemy.exc import OperationalError

from core.messages import parse_line
from db.connection import get_engine, session_for
from db.models import Job, MetricPoint
from tests.unit.test_relay_order import _batch, _relay
from workers import relay as relay_mod

STEPS = 250
NAMES = ("loss", "step_time_ms")


def _feed_steps(relay: relay_mod.Relay, trials: int) -> int:
    seq = 0
    for step in range(1, STEPS + 1):
        for trial in range(trials):
            for name in NAMES:
                line = {"seq": seq, "trial": trial, "kind": "metric", "step": step, "name": name,
                        "value": 1.0 / step, "time": time.time()}  # fmt: skip
                seq += 1
                msg = parse_line(json.dumps(line))
                relay.add(msg.trial, msg)
    return seq


def _series(db_url: str, job_id: int) -> list[tuple[str, int]]:
    with session_for(db_url) as s:
        rows = s.query(MetricPoint.name, MetricPoint.step).filter(MetricPoint.job_id == job_id).all()
        return sorted((r.name, r.step) for r in rows)


def test_a_backlog_goes_in_slices_each_line_once(db_url: str) -> None:
    _, won = _batch(db_url, 2)
    relay = _relay(db_url, won)
    lines = _feed_steps(relay, 2)
    commits: list[float] = []
    engine = get_engine(db_url)

    def count(_conn) -> None:  # noqa: ANN001
        commits.append(time.monotonic())

    event.listen(engine, "commit", count)
    try:
        relay.flush()
    finally:
        event.remove(engine, "commit", count)
    slices = -(-lines // relay_mod.FLUSH_SLICE_LINES)
    assert slices >= 3
    assert len(commits) == slices, f"{lines} lines in {len(commits)} commits"
    # between slices the lock is free for at least the gap
    gaps = [b - a for a, b in zip(commits, commits[1:], strict=False)]
    assert min(gaps) >= relay_mod.FLUSH_SLICE_GAP_S
    assert relay.pending() == 0
    want = sorted((n, st) for st in range(1, STEPS + 1) for n in NAMES)
    for t, a in won:
        assert _series(db_url, a.job_id) == want, t.index
    assert relay.close()


def test_a_slice_that_fails_keeps_the_earlier_slices_and_the_rest_lands_once(
    db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    _, won = _batch(db_url, 2)
    relay = _relay(db_url, won)
    _feed_steps(relay, 2)
    real = relay_mod.Relay._apply
    calls = {"n": 0}

    def second_fails(self, lines, progress, **kw):  # noqa: ANN001, ANN003, ANN202
        calls["n"] += 1
        if calls["n"] == 2:  # the database goes away after the first slice's commit
            raise OperationalError("INSERT", {}, Exception("database is locked"))
        return real(self, lines, progress, **kw)

    monkeypatch.setattr(relay_mod.Relay, "_apply", second_fails)
    with pytest.raises(OperationalError):
        relay.flush()
    kept = sum(len(_series(db_url, a.job_id)) for _, a in won)
    assert kept == relay_mod.FLUSH_SLICE_LINES  # the first slice, committed
    assert relay.pending() == 2 * STEPS * len(NAMES) - kept
    relay.flush()
    assert relay.pending() == 0
    want = sorted((n, st) for st in range(1, STEPS + 1) for n in NAMES)
    with session_for(db_url) as s:
        for _, a in won:
            assert _series(db_url, a.job_id) == want
            assert s.get(Job, a.job_id).applied_seq is not None
    assert relay.close()
