"""A selection batch with `fuse: true` over HTTP on the real stack: a Celery worker trains the
fusable trials as one stacked model (trainer/selection/fused_batch.py) and the odd one through the
executor; the leaderboard, series and logs read as for any batch. And the combinations refused."""

from __future__ import annotations

from typing import Any

import pytest

from tests.conftest import TINY_SPEC, StackHandle, grid_batch

pytestmark = pytest.mark.integration

BASE = {**TINY_SPEC, "name": "fused", "train": {**TINY_SPEC["train"], "steps": 12, "eval_every": 4}}


def test_a_fused_batch_runs_on_the_stack(stack: StackHandle) -> None:
    # two fusable pairs (batch 8 and batch 4): two stacks of two
    body = grid_batch(
        "fused-lr", BASE, {"train.lr": [1e-3, 3e-3], "train.batch_size": [8, 4]}, devices=2, fuse=True
    )
    sel = stack.submit_selection(body)
    assert sel["request"]["fuse"] is True and len(sel["trials"]) == 4
    done = stack.wait_selection(sel["id"])
    assert done["status"] == "succeeded", done
    trials = {tr["id"]: tr for tr in done["trials"]}
    assert all(tr["status"] == "succeeded" and tr["steps_done"] == 12 for tr in trials.values())
    board = [trials[i]["best_metric"] for i in done["leaderboard"]]
    assert board == sorted(board) and len(board) == 4
    for tr in trials.values():
        series = stack.client.get(
            f"/api/jobs/{tr['job_id']}/metrics", params={"names": "loss,val_loss"}
        ).json()
        assert series["series"]["loss"]["steps"] == list(range(1, 13))
        assert series["series"]["val_loss"]["steps"] == [4, 8, 12]
        assert min(series["series"]["val_loss"]["values"]) == pytest.approx(tr["best_metric"])
        logs = stack.client.get(f"/api/jobs/{tr['job_id']}/logs").json()["items"]
        assert any("fused with trials" in e["message"] for e in logs), logs


def test_fuse_with_early_stopping_or_a_sampler_is_refused(stack: StackHandle) -> None:
    def post(**over: Any) -> tuple[int, str]:
        body = {"base": BASE, "space": {"train.lr": [1e-3, 2e-3]}, "method": "grid", "fuse": True, **over}
        r = stack.client.post("/api/selections", json=body)
        return r.status_code, str(r.json()["detail"])

    code, msg = post(early_stopping={"kind": "asha", "reduction_factor": 3, "min_steps": 4})
    assert code == 422 and "fuse cannot be combined with early_stopping" in msg, msg
    code, msg = post(method="tpe", space={"train.lr": {"low": 1e-4, "high": 1e-2, "log": True}}, trials=4)
    assert code == 422 and "fuse cannot be combined with method tpe" in msg, msg
    code, msg = post(fuse="sometimes")
    assert code == 422 and "fuse" in msg, msg
