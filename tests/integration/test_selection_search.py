"""A TPE batch over HTTP on the real stack: it grows a generation at a time as results come in, and
each generation is exactly what the seeded sampler asks from the earlier trials' values."""

from __future__ import annotations

import pytest

from core.search import suggest
from tests.conftest import TINY_SPEC, StackHandle

pytestmark = pytest.mark.integration

BASE = {**TINY_SPEC, "name": "tpe", "train": {**TINY_SPEC["train"], "steps": 6, "eval_every": 3}}
SPACE = {"train.lr": {"low": 1e-4, "high": 3e-2, "log": True}}


def test_tpe_batch_grows_by_generations_reproducibly(stack: StackHandle) -> None:
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
    resp = stack.client.post("/api/selections", json=body)
    assert resp.status_code == 201, resp.text
    sel = resp.json()
    assert len(sel["trials"]) == 2  # the first generation only
    # a sampler batch grows itself; adding trials by hand is refused
    more = stack.client.post(f"/api/selections/{sel['id']}/trials", json={"trials": 1})
    assert more.status_code == 409 and "method tpe" in more.json()["detail"]

    done = stack.wait_selection(sel["id"])
    assert done["status"] == "succeeded" and done["error"] is None
    trials = sorted(done["trials"], key=lambda t: t["index"])
    assert [t["index"] for t in trials] == [0, 1, 2, 3]
    assert all(t["status"] == "succeeded" and t["best_metric"] is not None for t in trials)
    # generation 2 is what the sampler asks after being told generation 1's values in index order
    want = suggest(
        space=SPACE,
        method="tpe",
        seed=5,
        mode="min",
        parallel=2,
        values=[t["best_metric"] for t in trials[:2]],
        total=4,
        startup_trials=2,
    )
    assert [t["params"] for t in trials] == want
    # the submit's first generation is the same replay with no values
    assert [t["params"] for t in sel["trials"]] == want[:2]
