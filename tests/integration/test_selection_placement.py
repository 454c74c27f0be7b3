"""Selection groups placed by the scheduler on the real stack: redis-server, the API (with its
embedded scheduler) and two Celery workers with ONE rank slot and one task each, real trainers.

A batch of two 1-device groups runs one group on each worker (read from the trials' jobs and the
reservations over REST); a group that finds no free worker waits queued with the scheduler's
reason (its trial's job and GET /api/queue say so) and runs once a worker frees up; a group whose
worker is killed moves to the other one. Nothing here depends on timing: order is read from the
database and REST."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from typing import Any

import pytest

from api.stack import Stack
from tests.conftest import LOST_WORKER_WINDOWS, TERMINAL, TINY_SPEC, StackHandle, running

pytestmark = pytest.mark.integration

ENV = {
    "SHARDYARD_WORKER_SLOTS": "1",
    "SHARDYARD_SCHEDULER_S": "0.5",
    **LOST_WORKER_WINDOWS,
    "SHARDYARD_SSE_KEEPALIVE_S": "1",
}
STEPS = 8
BASE = {**TINY_SPEC, "name": "placed", "train": {**TINY_SPEC["train"], "steps": STEPS, "eval_every": 4}}
LONG = {**TINY_SPEC, "name": "long", "train": {**TINY_SPEC["train"], "steps": 1_000_000, "eval_every": 1000}}


@pytest.fixture(scope="module")
def two(tmp_path_factory: pytest.TempPathFactory) -> Iterator[StackHandle]:
    st = Stack(root=tmp_path_factory.mktemp("selplace"), workers=2, concurrency=1, extra_env=ENV)
    with running(st) as handle:
        yield handle


def _batch(h: StackHandle, base: dict[str, Any], lrs: list[float]) -> dict[str, Any]:
    body = {
        "name": base["name"],
        "base": base,
        "space": {"train.lr": lrs},
        "method": "grid",
        "devices": 1,
        "group_size": 1,
    }
    return h.submit_selection(body)


def _selection(h: StackHandle, sid: int) -> dict[str, Any]:
    return h.client.get(f"/api/selections/{sid}").json()


def _until(check, what: str, timeout: float = 180) -> Any:  # noqa: ANN001
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if got := check():
            return got
        time.sleep(0.2)
    raise AssertionError(f"{what}: not within {timeout} s")


def test_a_batch_of_two_groups_runs_one_group_on_each_worker(two: StackHandle) -> None:
    sel = _batch(two, BASE, [1e-3, 3e-3])
    jobs = [t["job_id"] for t in sel["trials"]]
    # each group holds the one slot of a different worker while it runs (its reservation, over REST)
    seen: dict[int, str] = {}

    def both_reserved() -> bool:
        for j in jobs:
            if (job := two.job(j))["reservation"]:
                (r,) = job["reservation"]
                assert (r["slots"], r["nnodes"]) == (1, 1)
                seen[j] = r["worker"]
        return len(seen) == 2 or _selection(two, sel["id"])["status"] in TERMINAL

    _until(both_reserved, "both groups reserved")
    done = two.wait_selection(sel["id"])
    assert done["status"] == "succeeded", done
    workers = {two.job(j)["worker"] for j in jobs}
    assert len(workers) == 2, f"both groups ran on one worker: {workers}"
    if len(seen) == 2:
        assert {seen[j] for j in jobs} == workers
    for trial in done["trials"]:
        assert trial["status"] == "succeeded" and trial["result"]["steps"] == STEPS, trial
        assert trial["best_metric"] is not None
        got = two.client.get(f"/api/jobs/{trial['job_id']}/metrics", params={"names": "loss"}).json()
        assert got["series"]["loss"]["steps"] == list(range(1, STEPS + 1))  # every step once
        job = two.job(trial["job_id"])
        assert job["attempts"] == 1 and job["reservation"] == []  # freed at the group's end
    # the two trials differ only in lr: different losses prove each ran its own params
    assert done["trials"][0]["best_metric"] != done["trials"][1]["best_metric"]


def test_a_group_waits_with_a_reason_until_a_worker_frees_up(two: StackHandle) -> None:
    busy = _batch(two, LONG, [1e-3, 2e-3])
    busy_jobs = [t["job_id"] for t in busy["trials"]]
    # both workers run a group of the long batch at once
    _until(lambda: all(two.job(j)["status"] == "running" for j in busy_jobs), "the long groups run at once")
    assert len({two.job(j)["worker"] for j in busy_jobs}) == 2
    waiting = _batch(two, BASE, [5e-3])
    (trial,) = waiting["trials"]
    job = two.wait_until(trial["job_id"], lambda j: j["wait_reason"] is not None, timeout=60)
    assert job["status"] == "queued" and job["reservation"] == []
    assert (
        job["wait_reason"]
        == "workers busy: needs 1 free slot(s); most free now: 0 (the fleet can hold it once running jobs end)"
    )
    queue = two.client.get("/api/queue").json()["items"]
    entry = next(e for e in queue if e["job_id"] == trial["job_id"])
    assert (entry["selection_id"], entry["trial_ids"]) == (waiting["id"], [trial["id"]])
    assert entry["wait_reason"] == job["wait_reason"] and entry["position"] == job["queue_position"]
    # stop one long trial: its group ends, its worker's slot is freed, and the waiting group runs there
    stopped = busy["trials"][0]
    resp = two.client.post(f"/api/selections/{busy['id']}/trials/{stopped['id']}/stop")
    assert resp.status_code == 200, resp.text
    done = two.wait_selection(waiting["id"])
    assert done["status"] == "succeeded" and done["trials"][0]["result"]["steps"] == STEPS, done
    ran = two.job(trial["job_id"])
    assert ran["worker"] == two.job(stopped["job_id"])["worker"] and ran["wait_reason"] is None
    # cancelling the long batch frees the other group's reservation
    assert two.client.post(f"/api/selections/{busy['id']}/cancel").status_code == 200
    ended = two.wait_selection(busy["id"])
    assert ended["status"] == "cancelled"
    assert ended["trials"][0]["status"] == "stopped" and ended["trials"][1]["status"] in (
        "stopped",
        "cancelled",
    )
    _until(lambda: all(two.job(j)["reservation"] == [] for j in busy_jobs), "reservations freed", 60)
    assert two.client.get("/api/queue").json()["items"] == []


def test_a_batch_whose_groups_no_worker_can_hold_is_refused(two: StackHandle) -> None:
    """Each group runs on one worker: 2 devices on 1-slot workers could never be placed."""
    body = {"name": "wide", "base": BASE, "space": {"train.lr": [1e-3]}, "method": "grid", "devices": 2}
    resp = two.client.post("/api/selections", json=body)
    assert resp.status_code == 422, resp.text
    detail = resp.json()["detail"]
    assert detail.startswith("devices: each group of the batch runs as one process on one worker over 2")
    assert "largest: 1 slots" in detail


def test_a_group_whose_worker_dies_runs_again_on_the_other_worker(two: StackHandle) -> None:
    """kill -9 of the worker (and its trainer) running a group: the trial's lease runs out, the
    reconciler gives it back, its reservation is freed, and the scheduler places the group on the
    surviving worker; it resumes from its checkpoint and stores every step once."""
    steps = 100
    spec = {
        **TINY_SPEC,
        "name": "moved",
        "checkpoint_every": 4,
        "train": {**TINY_SPEC["train"], "steps": steps, "eval_every": 10},
    }
    sel = _batch(two, spec, [1e-3])
    job_id = sel["trials"][0]["job_id"]
    first = two.wait_until(job_id, lambda j: j["progress"]["step"] >= 6, timeout=180)
    (held,) = first["reservation"]
    assert held["worker"] == first["worker"]
    index = int(first["worker"].split("@")[0].removeprefix("worker"))
    proc = two.stack.procs.pop(f"worker{index}")
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    try:
        done = two.wait_selection(sel["id"], timeout=240)
        assert done["status"] == "succeeded", done
        job = two.job(job_id)
        assert job["attempts"] == 2 and job["worker"] != first["worker"], job
        assert job["reservation"] == []
        got = two.client.get(f"/api/jobs/{job_id}/metrics", params={"names": "loss,val_loss"}).json()
        assert got["series"]["loss"]["steps"] == list(range(1, steps + 1))  # every step once
        assert got["series"]["val_loss"]["steps"] == list(range(10, steps + 1, 10))
    finally:
        two.stack.start_worker(index)
