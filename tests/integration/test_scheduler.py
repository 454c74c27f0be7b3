"""The scheduler on the real stack: redis-server, the API (with its embedded scheduler) and two
Celery workers (worker1@, worker2@) with 2 rank slots and one task each, real trainers.

Start order is read from the database (each job's `running` status event, in commit order), never
from timing. To hold the queue still while it fills, both workers first run a long blocker job of
the highest priority; a test then frees one worker by cancelling its blocker."""

from __future__ import annotations

import secrets
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import select

from api.stack import Stack
from db.connection import session_for
from db.models import JobEvent
from tests.conftest import TERMINAL, TINY_SPEC, StackHandle, long_job, running
from tests.user_data import held_data, upload_held

pytestmark = pytest.mark.integration

ENV = {
    "SHARDYARD_WORKER_SLOTS": "2",
    "SHARDYARD_PREEMPTION": "1",
    "SHARDYARD_SCHEDULER_S": "0.5",
    "SHARDYARD_HEARTBEAT_S": "1",
    "SHARDYARD_SSE_KEEPALIVE_S": "1",
}
SHORT = {**TINY_SPEC, "name": "short", "train": {**TINY_SPEC["train"], "steps": 2, "eval_every": 2}}
BLOCKER = {
    **TINY_SPEC,
    "name": "blocker",
    "priority": 50,
    "train": {**TINY_SPEC["train"], "steps": 100_000, "eval_every": 50_000},
}
# the victim of the preemption test is held at its 20th batch until the preemption has asked it to
# stop (tests/user_data.py), so the preemption lands mid-job whatever the machine's speed (20 steps
# of TINY_SPEC had ended before it in one CI run; 300 of long_job last ~15 s on an idle machine)
STEPS = 300
_LONG = long_job("preemptible", STEPS)
PREEMPTIBLE = {**_LONG, "train": {**_LONG["train"], "eval_every": 100}}


@pytest.fixture(scope="module")
def two(tmp_path_factory: pytest.TempPathFactory) -> Iterator[StackHandle]:
    st = Stack(root=tmp_path_factory.mktemp("sched"), workers=2, concurrency=1, extra_env=ENV)
    with running(st) as handle:
        yield handle


def _user(h: StackHandle) -> httpx.Client:
    resp = h.client.post("/api/users", json={"name": f"u{secrets.token_hex(4)}"})
    assert resp.status_code == 201, resp.text
    return httpx.Client(
        base_url=h.base_url, timeout=30, headers={"Authorization": f"Bearer {resp.json()['token']}"}
    )


def _submit(c: httpx.Client, spec: dict[str, Any]) -> int:
    resp = c.post("/api/jobs", json=spec)
    assert resp.status_code == 201, resp.text
    return resp.json()["id"]


def _starts(h: StackHandle, ids: list[int]) -> list[int]:
    """Every attempt start of the jobs `ids`, in commit order (their `running` status events)."""
    with session_for(h.stack.database_url) as s:
        return list(
            s.scalars(
                select(JobEvent.job_id)
                .where(JobEvent.job_id.in_(ids), JobEvent.kind == "status", JobEvent.message == "running")
                .order_by(JobEvent.id)
            )
        )


def _start_order(h: StackHandle, ids: list[int]) -> list[int]:
    """Jobs of `ids` in the order their first attempt started."""
    return list(dict.fromkeys(_starts(h, ids)))


def _blockers(h: StackHandle) -> list[int]:
    ids = [h.submit(BLOCKER)["id"] for _ in range(2)]
    for job_id in ids:
        h.wait(job_id, statuses=("running",), timeout=180)
    workers = {h.job(j)["reservation"][0]["worker"] for j in ids}
    assert len(workers) == 2, "one blocker per worker"
    return ids


def _cancel_all(h: StackHandle, ids: list[int]) -> None:
    for job_id in ids:
        if h.job(job_id)["status"] not in TERMINAL:
            h.client.post(f"/api/jobs/{job_id}/cancel")
    for job_id in ids:
        h.wait(job_id, statuses=TERMINAL, timeout=120)


def _until(check, timeout: float = 60) -> None:  # noqa: ANN001
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.2)
    raise AssertionError("condition not met")


def test_high_priority_job_behind_ten_low_ones_runs_next(two: StackHandle) -> None:
    blockers = _blockers(two)
    low = [_submit(two.client, SHORT) for _ in range(10)]
    high = _submit(two.client, {**SHORT, "name": "urgent", "priority": 5})
    # the queue view puts it first, and the low ones say why they wait
    _until(lambda: (q := two.client.get("/api/queue").json())["items"] and q["items"][0]["job_id"] == high)
    _until(lambda: two.job(low[-1])["wait_reason"] == f"behind higher-priority job {high}")
    assert two.job(high)["queue_position"] == 1
    assert two.job(low[0])["queue_position"] == 2
    assert two.job(high)["wait_reason"].startswith("workers busy: needs")
    two.client.post(f"/api/jobs/{blockers[0]}/cancel")
    done = two.wait(high, timeout=180)
    assert done["attempts"] == 1
    _cancel_all(two, [blockers[1], *low])
    assert _start_order(two, [*low, high])[0] == high


def test_two_users_get_alternating_slots(two: StackHandle) -> None:
    """Ann queues three jobs before Bob queues his three (FIFO would run all of Ann's first); one
    worker is freed, so they run one at a time: the slots alternate Ann, Bob, Ann, Bob."""
    blockers = _blockers(two)
    with _user(two) as ann, _user(two) as bob:
        a = [_submit(ann, SHORT) for _ in range(3)]
        b = [_submit(bob, SHORT) for _ in range(3)]
        # a user sees only their own entries, with their places in the whole queue
        mine = bob.get("/api/queue").json()
        assert [e["job_id"] for e in mine["items"]] == b and mine["total"] == 6
        assert [e["position"] for e in mine["items"]] == [2, 4, 6]
    two.client.post(f"/api/jobs/{blockers[0]}/cancel")
    _until(lambda: len(_start_order(two, a + b)) >= 4, timeout=300)
    order = _start_order(two, a + b)[:4]
    _cancel_all(two, [blockers[1], *a, *b])
    owners = ["ann" if j in a else "bob" for j in order]
    assert owners == ["ann", "bob", "ann", "bob"], order


def test_preemption_requeues_and_the_job_still_finishes_exactly_once(two: StackHandle, gate: Path) -> None:
    blocker = two.submit(BLOCKER)["id"]
    two.wait(blocker, statuses=("running",), timeout=180)
    victim = two.submit({**PREEMPTIBLE, **held_data(upload_held(two), gate, hold_at=20)})["id"]
    two.wait_until(victim, lambda j: j["progress"]["step"] >= 6, timeout=180)
    urgent = _submit(two.client, {**SHORT, "name": "urgent", "priority": 10})
    # the preemption asks the held victim to stop (its stop file); it stops at its next step
    stop = two.stack.root / "jobs" / str(victim) / "stop"
    _until(stop.exists, timeout=120)
    gate.unlink()
    two.wait(urgent, timeout=240)
    done = two.wait(victim, timeout=240)
    _cancel_all(two, [blocker])
    assert done["attempts"] == 2
    got = two.client.get(f"/api/jobs/{victim}/metrics", params={"names": "loss,val_loss"}).json()
    assert got["series"]["loss"]["steps"] == list(range(1, STEPS + 1))
    assert got["series"]["val_loss"]["steps"] == [100, 200, 300]
    events = two.client.get(f"/api/jobs/{victim}/logs").json()["items"]
    requeued = [e for e in events if e["kind"] == "status" and e["message"] == "queued" and e["data"]]
    assert any(f"preempted by job {urgent}" in (e["data"].get("reason") or "") for e in requeued), requeued
    # the urgent job took the victim's slots: it started between the victim's two attempts
    assert _starts(two, [urgent, victim]) == [victim, urgent, victim]
