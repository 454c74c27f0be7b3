"""A trial's lines in any order, through the worker's real Relay into a real database (SQLite and
PostgreSQL): its result is kept whether it comes before or after its final event, and a trial
whose worker dies between the two is re-run, never ended with an empty result."""

from __future__ import annotations

import time

from core.messages import parse_line
from core.settings import Settings
from db import jobs as dbj
from db import selections as dbs
from db.connection import session_for
from db.models import Job, Trial
from workers.relay import Relay, Target


def _line(seq: int, trial: int, kind: str, **body) -> str:
    import json

    return json.dumps({"seq": seq, "trial": trial, "kind": kind, **body, "time": time.time()})


def _batch(db_url: str, n: int) -> tuple[int, list[tuple[Trial, dbj.Attempt]]]:
    with session_for(db_url) as s:
        sel = dbs.create_selection(s, name="b", request={}, metric="val_loss", mode="min", scheduler="x")
        spec = {"train": {"steps": 4}}
        dbs.add_trials(s, selection_id=sel.id, plans=[(i, {}, spec) for i in range(n)], queue="cpu")
        ids = [t.id for t in dbs.get_selection(s, sel.id).trials]
        return sel.id, dbs.claim_trials(s, trial_ids=ids, owner="me", worker="w", lease_s=30)


def _relay(db_url: str, won: list[tuple[Trial, dbj.Attempt]], *, flush_s: float = 3600) -> Relay:
    """A relay over the claimed trials; by default its flusher never ticks (the test flushes)."""
    settings = Settings(database_url=db_url, broker_url="redis://127.0.0.1:9/0", lease_s=30, db_retry_s=5)
    targets = {t.index: Target(attempt=a, channels=(), trial_id=t.id) for t, a in won}
    return Relay(settings, targets=targets, on_fenced=lambda _k: None, flush_s=flush_s)


def _feed(relay: Relay, *lines: str) -> None:
    for raw in lines:
        msg = parse_line(raw)
        relay.add(msg.trial, msg)


def _trial(db_url: str, trial_id: int) -> tuple[str, dict | None, str, dict | None]:
    with session_for(db_url) as s:
        t = s.get(Trial, trial_id)
        job = s.get(Job, t.job_id)
        return t.status, t.result, job.status, job.result


def test_a_trial_result_is_kept_before_or_after_its_final_event(db_url: str) -> None:
    sid, won = _batch(db_url, 2)
    (t0, _), (t1, _) = won
    relay = _relay(db_url, won)
    result = {"steps": 4, "compute_s": 0.5, "copy_s": 0.1, "best_metric": 1.25, "stop_reason": None}
    _feed(
        relay,
        _line(0, 0, "metric", step=4, name="val_loss", value=1.25),
        _line(1, 0, "result", data=result),  # result first ...
        _line(2, 0, "event", event="trial", data={"status": "succeeded", "steps_done": 4}),
        _line(3, 1, "metric", step=4, name="val_loss", value=2.5),
        _line(4, 1, "event", event="trial", data={"status": "stopped_early", "steps_done": 4}),
    )
    relay.flush()
    assert _trial(db_url, t0.id) == ("succeeded", result, "succeeded", result)
    # ... and after: trial 1 has its final event but not yet its result, so it has not ended
    assert _trial(db_url, t1.id)[0::2] == ("running", "running")
    _feed(relay, _line(5, 1, "result", data={**result, "best_metric": 2.5}))
    relay.flush()
    status, got, job_status, _ = _trial(db_url, t1.id)
    assert (status, job_status, got["best_metric"]) == ("stopped_early", "succeeded", 2.5)
    assert relay.close()
    with session_for(db_url) as s:
        fields = dbs.trial_fields(s.get(Trial, t0.id))
        assert (fields["compute_s"], fields["copy_s"], fields["best_metric"]) == (0.5, 0.1, 1.25)
        assert dbs.settle_selection(s, selection_id=sid) == "succeeded"


def test_a_worker_dying_between_a_trials_final_event_and_its_result_reruns_the_trial(db_url: str) -> None:
    sid, won = _batch(db_url, 1)
    ((t0, _),) = won
    relay = _relay(db_url, won)
    _feed(relay, _line(0, 0, "event", event="trial", data={"status": "succeeded", "steps_done": 4}))
    relay.flush()
    relay._stop.set()  # the worker dies here: the result line never reaches the database
    assert _trial(db_url, t0.id) == ("running", None, "running", None)
    with session_for(db_url) as s:
        s.execute(Job.__table__.update().where(Job.id == t0.job_id).values(lease_until=None))
        s.commit()
        requeued, _ = dbj.expire_leases(s)
        dbs.sync_trials(s, job_ids=[j.id for j in requeued])
        assert dbs.settle_selection(s, selection_id=sid) == "queued"
    assert _trial(db_url, t0.id)[0::2] == ("queued", "queued")


def test_a_trial_stopped_by_a_warm_shutdown_has_not_ended(db_url: str) -> None:
    from workers.supervise import DRAIN

    _, won = _batch(db_url, 1)
    ((t0, _),) = won
    relay = _relay(db_url, won)
    DRAIN.set()
    try:
        _feed(
            relay,
            _line(0, 0, "event", event="trial", data={"status": "stopped", "steps_done": 2}),
            _line(1, 0, "result", data={"steps": 2, "status": "stopped"}),
        )
        assert relay.close()
    finally:
        DRAIN.clear()
    # its result is kept, and it is still the group's to give back to the queue (workers/selection.py)
    assert _trial(db_url, t0.id) == (
        "running",
        {"steps": 2, "status": "stopped"},
        "running",
        {"steps": 2, "status": "stopped"},
    )
