"""A lost order, from the worker's side (workers/intake.py) and the database's (db/scheduling.py
unclaimed_orders, order_lost), on a real database (SQLite and PostgreSQL) with the real scheduler
loop; the broker is replaced by a recorder of what would be sent (the integration tests,
tests/integration/test_lost_orders.py, run the real workers and redis-server). The intake's clock
is a counter the test moves, not the wall clock."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from core.scheduler_loop import Scheduler
from core.settings import Settings
from db import jobs as dbj
from db import scheduling as dbs
from db.connection import session_for
from db.models import Reservation
from tests.conftest import beat
from workers.intake import Intake

SPEC = {
    "model": {"kind": "gpt", "layers": 1, "d_model": 16, "heads": 1, "seq_len": 8, "vocab_size": 64},
    "train": {"steps": 1, "batch_size": 2},
}
T0 = datetime(2026, 1, 1, tzinfo=UTC)


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def _order(rid: int = 1, sent: datetime = T0) -> dbs.Order:
    return dbs.Order(reservation_id=rid, job_id=rid, sent_at=sent)


def test_a_worker_that_never_was_free_asks_for_nothing() -> None:
    clock = Clock()
    intake = Intake(grace_s=5, clock=clock)
    o = _order()
    assert intake.lost([o]) == []
    intake.sample(False)
    clock.t += 60
    assert intake.lost([o]) == []


def test_the_wait_runs_from_the_later_of_first_sight_and_the_start_of_the_free_span() -> None:
    clock = Clock()
    intake = Intake(grace_s=5, clock=clock)
    intake.sample(True)  # free long before the order shows
    clock.t += 100
    o = _order()
    assert intake.lost([o]) == [], "first seen now: the message may not even be published yet"
    clock.t += 4.9
    assert intake.lost([o]) == []
    clock.t += 0.2
    assert intake.lost([o]) == [o]
    assert intake.lost([o]) == [], "asked once: its wait starts again at the next sight"

    busy = _order(2)
    assert intake.lost([busy]) == []
    clock.t += 3
    intake.sample(False)  # took a task: the order may be the one it runs
    intake.sample(True)
    clock.t += 4
    assert intake.lost([busy]) == [], "free for 4 s only since the break"
    clock.t += 1.5
    assert intake.lost([busy]) == [busy]


def test_an_order_sent_again_waits_its_own_grace() -> None:
    clock = Clock()
    intake = Intake(grace_s=5, clock=clock)
    intake.sample(True)
    first = _order(sent=T0)
    intake.lost([first])
    clock.t += 4
    again = _order(sent=datetime(2026, 1, 1, 0, 0, 9, tzinfo=UTC))  # the scheduler sent it again
    assert intake.lost([again]) == []
    clock.t += 4
    assert intake.lost([again]) == [], "8 s since the first send, 4 since the new one"
    clock.t += 1
    assert intake.lost([again]) == [again]


class Sent:
    def __init__(self) -> None:
        self.calls: list[tuple[int, str]] = []

    def __call__(self, _settings: Settings, *, job_id: int, queue: str, **_kw: Any) -> None:
        self.calls.append((job_id, queue))


def test_an_order_marked_lost_is_sent_again_next_tick_and_only_then(db_url: str) -> None:
    beat(db_url, "w1@h")
    beat(db_url, "w2@h")
    with session_for(db_url) as s:
        job = dbj.create_job(s, name="j", spec=SPEC).id
    sent = Sent()
    sched = Scheduler(Settings(database_url=db_url), send=sent)  # requeue_after_s: 600 s
    sched.tick()
    ((_, queue),) = sent.calls
    worker = queue.removeprefix("node.")
    other = "w2@h" if worker == "w1@h" else "w1@h"
    with session_for(db_url) as s:
        (order,) = dbs.unclaimed_orders(s, worker=worker)
        assert dbs.unclaimed_orders(s, worker=other) == []
    assert order.job_id == job
    sched.tick()
    assert len(sent.calls) == 1, "unclaimed but not lost: not sent again"

    with session_for(db_url) as s:
        assert dbs.order_lost(s, order=order)
        assert not dbs.order_lost(s, order=order), "already marked"
    sched.tick()
    assert sent.calls == [(job, queue), (job, queue)], "sent again, to the same worker"
    with session_for(db_url) as s:
        (again,) = dbs.unclaimed_orders(s, worker=worker)
    assert again.reservation_id == order.reservation_id and again.sent_at is not None
    with session_for(db_url) as s:
        assert not dbs.order_lost(s, order=order), "a stale sighting does not undo the new send"

    with session_for(db_url) as s:
        assert dbj.claim_job(s, job_id=job, owner="o", worker=worker, lease_s=30, reserved=True) is not None
    with session_for(db_url) as s:
        assert dbs.unclaimed_orders(s, worker=worker) == []
        assert not dbs.order_lost(s, order=again), "claimed: nothing to send"
        (row,) = s.query(Reservation).filter_by(job_id=job).all()
        assert row.claimed_at is not None and row.sent_at is not None


def test_an_order_asked_for_again_and_again_waits_twice_as_long_each_time() -> None:
    """An order the worker gets and drops without a claim (a task it does not know) stays
    unclaimed after each re-send: the asks come ever less often, up to BACKOFF_MAX grace periods,
    not every few seconds for ever."""
    from workers.intake import BACKOFF_MAX

    clock = Clock()
    intake = Intake(grace_s=5, clock=clock)
    intake.sample(True)
    waits = []
    for k in range(9):
        o = _order(sent=datetime(2026, 1, 1, 0, k, tzinfo=UTC))  # each re-send has a new sent_at
        assert intake.lost([o]) == []
        waited = 0.0
        while not intake.lost([o]):
            clock.t += 1
            waited += 1
        waits.append(waited)
    assert waits == [5, 10, 20, 40, 80, 160, 320, 5 * BACKOFF_MAX, 5 * BACKOFF_MAX]
    assert intake.times_asked(1) == 9
    intake.lost([])  # claimed at last: forgotten
    assert intake.times_asked(1) == 0
