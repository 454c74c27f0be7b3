"""Fusion on by default over HTTP on the real stack: a Celery worker measures the trials' stacks,
trains them fused (trainer/selection/fused_batch.py), and each trial's API data says with whom
(`fused_with`); the leaderboard, series and logs read as for any batch. And `fuse` is a boolean."""

from __future__ import annotations

import pytest

from tests.conftest import TINY_SPEC, StackHandle, grid_batch

pytestmark = pytest.mark.integration

# small enough that a step is mostly dispatch, so stacking pays on any machine
BASE = {
    **TINY_SPEC,
    "name": "fused",
    "model": {**TINY_SPEC["model"], "d_model": 16, "seq_len": 8},
    "train": {**TINY_SPEC["train"], "steps": 12, "eval_every": 4, "batch_size": 4},
}


def test_a_default_batch_fuses_and_says_with_whom(stack: StackHandle) -> None:
    body = grid_batch("fused-lr", BASE, {"train.lr": [1e-3, 2e-3, 3e-3, 4e-3]}, devices=2)
    sel = stack.submit_selection(body)
    assert sel["request"].get("fuse", True) is True and len(sel["trials"]) == 4
    done = stack.wait_selection(sel["id"])
    assert done["status"] == "succeeded", done
    trials = {tr["index"]: tr for tr in done["trials"]}
    assert all(tr["status"] == "succeeded" and tr["steps_done"] == 12 for tr in trials.values())
    board = [
        tr["best_metric"] for tr in sorted(done["trials"], key=lambda t: done["leaderboard"].index(t["id"]))
    ]
    assert board == sorted(board) and len(board) == 4
    # every trial trained in a stack, and the stacks agree on who was in them
    for i, tr in trials.items():
        assert tr["fused_with"], tr
        assert tr["result"]["fused_with"] == tr["fused_with"]
        for j in tr["fused_with"]:
            assert i in trials[j]["fused_with"]
        series = stack.client.get(
            f"/api/jobs/{tr['job_id']}/metrics", params={"names": "loss,val_loss"}
        ).json()
        assert series["series"]["loss"]["steps"] == list(range(1, 13))
        assert series["series"]["val_loss"]["steps"] == [4, 8, 12]
        logs = stack.client.get(f"/api/jobs/{tr['job_id']}/logs").json()["items"]
        assert any("fused with trials" in e["message"] for e in logs), logs
    r = stack.client.post("/api/selections", json={**body, "fuse": "sometimes"})
    assert r.status_code == 422 and "fuse" in str(r.json()["detail"])
