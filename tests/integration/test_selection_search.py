"""A TPE batch over HTTP on the real stack: it asks its next trial as soon as a device frees (no
generation barrier), every trial is exactly what the seeded sampler asks from the earlier trials'
values (those its logical clock has ended when it asks: core/search.py), a rerun with the same seed
asks the same trials, and no point of a discrete space runs twice."""

from __future__ import annotations

import pytest

from core.search import request_plan
from jobrules.spec import SelectionCreate
from tests.conftest import TINY_SPEC, StackHandle

pytestmark = pytest.mark.integration

BASE = {**TINY_SPEC, "name": "tpe", "train": {**TINY_SPEC["train"], "steps": 6, "eval_every": 3}}
SPACE = {"train.lr": {"low": 1e-4, "high": 3e-2, "log": True}}


def test_tpe_batch_grows_reproducibly(stack: StackHandle) -> None:
    body = {
        "name": "tpe-lr",
        "base": BASE,
        "space": SPACE,
        "method": "tpe",
        "trials": 4,
        "parallel": 2,
        "startup_trials": 2,
        "seed": 5,
        "devices": 2,
        "checkpoints": "none",
    }
    sel = stack.submit_selection(body)
    assert len(sel["trials"]) == 2  # the first generation only
    # a sampler batch grows itself; adding trials by hand is refused
    more = stack.client.post(f"/api/selections/{sel['id']}/trials", json={"trials": 1})
    assert more.status_code == 409 and "method tpe" in more.json()["detail"]

    done = stack.wait_selection(sel["id"])
    assert done["status"] == "succeeded" and done["error"] is None
    trials = sorted(done["trials"], key=lambda t: t["index"])
    assert [t["index"] for t in trials] == [0, 1, 2, 3]
    assert all(t["status"] == "succeeded" and t["best_metric"] is not None for t in trials)
    # trials 2 and 3 are what the sampler asks once told the trials its clock ended before them
    want = replay(body, [t["best_metric"] for t in trials[:2]])
    assert [t["params"] for t in trials] == want
    # the submit's first trials are the same replay with no values
    assert [t["params"] for t in sel["trials"]] == want[:2]


# seed 6 asks trial 0 with 3 steps and trial 1 with 24 (core.search.plan, checked below): trial 0 ends
# first, and trial 2 (asked once trial 0 has ended) must start while trial 1 still runs; trial 3, the
# batch's last, is asked with it (core/search.py TAIL)
STEPS_SPACE = {"train.steps": [3, 24], "train.lr": {"low": 1e-3, "high": 3e-2, "log": True}}
ASYNC = {
    "name": "tpe-async",
    "base": {**BASE, "train": {**BASE["train"], "eval_every": 3}},
    "space": STEPS_SPACE,
    "method": "tpe",
    "trials": 4,
    "parallel": 2,
    "startup_trials": 2,
    "seed": 6,
    "devices": 2,
    "checkpoints": "none",
}


def replay(body: dict, values: list[float | None]) -> list[dict]:
    """The params the sampler asks for `body`'s trials (metric minimized) once trials 0 ..
    len(values) - 1 have ended: the replay the API and the workers run, on the request as stored."""
    req = SelectionCreate.model_validate(body).model_dump()
    return [a.params for a in request_plan(req, values=values).trials]


def run_batch(stack: StackHandle, body: dict) -> dict:
    done = stack.wait_selection(stack.submit_selection(body)["id"], timeout=400)
    done["trials"].sort(key=lambda t: t["index"])
    return done


def test_tpe_asks_as_devices_free_and_a_rerun_asks_the_same(stack: StackHandle) -> None:
    first = replay(ASYNC, [])
    assert [p["train.steps"] for p in first] == [3, 24]
    a = run_batch(stack, ASYNC)
    assert a["status"] == "succeeded" and a["error"] is None
    trials = a["trials"]
    assert [t["index"] for t in trials] == [0, 1, 2, 3]
    assert all(t["status"] == "succeeded" for t in trials)
    jobs = {t["index"]: stack.job(t["job_id"]) for t in trials}
    # no generation barrier: trial 2 started before trial 1 (asked with it) ended
    assert jobs[2]["started_at"] < jobs[1]["finished_at"]
    assert jobs[0]["finished_at"] <= jobs[2]["started_at"]  # and only once trial 0 had ended
    # the batch's last trial came with it (the clock asks it with the one before it)
    assert jobs[3]["started_at"] < jobs[1]["finished_at"]
    want = replay(ASYNC, [t["best_metric"] for t in trials[:2]])
    assert [t["params"] for t in trials] == want
    # the same seed again: the same trials, whichever finished first this time
    b = run_batch(stack, ASYNC)
    assert [t["params"] for t in b["trials"]] == [t["params"] for t in trials]


def test_no_point_of_a_discrete_space_runs_twice(stack: StackHandle) -> None:
    space = {"train.lr": [1e-3, 3e-3], "train.optimizer": ["adamw", "sgd"]}  # 4 points
    body = {**ASYNC, "name": "tpe-small", "space": space, "trials": 6, "seed": 1}
    done = run_batch(stack, body)
    points = [tuple(sorted(t["params"].items())) for t in done["trials"]]
    assert len(points) == 4 and len(set(points)) == 4
    assert done["status"] == "succeeded" and "every point of the space" in done["error"]
    # the asks that repeated an earlier point were not run, and the trial list says so
    repeats = {t["index"]: t["repeats_skipped"] for t in done["trials"] if t["repeats_skipped"]}
    assert repeats and all(j < k for k, js in repeats.items() for j in js)
