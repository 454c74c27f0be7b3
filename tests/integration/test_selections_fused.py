"""Fusion on by default over HTTP on the real stack: a Celery worker measures the trials' stacks,
trains them fused (trainer/selection/fused_batch.py), and each trial's API data says with whom
(`fused_with`); the leaderboard, series and logs read as for any batch. And `fuse` is a boolean.
The worker keeps what a group measured for the next group of the same architecture."""

from __future__ import annotations

import json

import pytest

from jobrules.step_costs import read
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


def test_a_later_batch_of_the_architecture_plans_from_the_line_the_worker_kept(stack: StackHandle) -> None:
    """The worker takes the lines a group's sandboxed trainer measured from its summary, keeps them
    in its host's file (workers/step_costs.py) and hands them to the next group's trainer: an ASHA
    batch of an architecture measured before measures nothing."""
    base = {**BASE, "name": "kept-costs", "model": {**BASE["model"], "d_model": 24}}
    asha = {"kind": "asha", "reduction_factor": 2, "min_steps": 4}
    fusion = []
    for lrs in ([1e-3, 2e-3, 3e-3], [4e-3, 5e-3, 6e-3]):
        body = grid_batch("kept-costs", base, {"train.lr": lrs}, devices=2, early_stopping=asha)
        sel = stack.submit_selection(body)
        done = stack.wait_selection(sel["id"])
        assert done["status"] == "succeeded", done
        summaries = list((stack.stack.root / "selections" / str(sel["id"])).glob("group-*.summary.json"))
        assert len(summaries) == 1, summaries
        fusion.append(json.loads(summaries[0].read_text())["fusion"])
    first, second = fusion
    assert first["measured"] and first["reused"] == 0, first
    assert second["measured"] == [] and second["reused"] >= 1, second
    assert second["costs"] == first["costs"]
    kept = {k for p in (stack.stack.root / "cache").glob("step-costs.*.json") for k in read(p)}
    assert {m["key"] for m in first["measured"]} <= kept
