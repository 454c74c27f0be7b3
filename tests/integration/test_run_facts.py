"""True facts about how runs ended, on the shared real stack: a job whose loss blew up is flagged
diverged (in its JSON, the job list, `shardyard show` and `shardyard follow`), and fails when its
spec asks; a trial of a batch is judged alike; a trial that early stopping cut short says so in
its job (what the compare view reads) and in `shardyard show`."""

from __future__ import annotations

from typing import Any

import pytest

from tests.conftest import StackHandle, grid_batch

pytestmark = pytest.mark.integration

# AdamW at lr 10 on a one-layer MLP: the loss goes from ~4.8 at step 1 to thousands by step 2 and
# stays there (finite: no NaN failure), seeded so every run does the same
BLOWS_UP: dict[str, Any] = {
    "name": "blows-up",
    "model": {"kind": "mlp", "layers": 1, "d_model": 16, "seq_len": 8},
    "data": {"max_chars": 20_000},
    "train": {"steps": 16, "batch_size": 4, "lr": 10.0, "eval_every": 4, "eval_batches": 1, "seed": 0},
}


def _with_train(spec: dict[str, Any], **train: Any) -> dict[str, Any]:
    return {**spec, "train": {**spec["train"], **train}}


def test_a_diverged_job_is_flagged_and_fail_on_divergence_fails_it(stack: StackHandle) -> None:
    flagged = stack.submit(BLOWS_UP)
    failing = stack.submit({**_with_train(BLOWS_UP, fail_on_divergence=True), "name": "blows-up-fails"})
    calm = stack.submit({**_with_train(BLOWS_UP, lr=3e-3), "name": "calm"})

    done = stack.wait(flagged["id"])
    assert done["diverged"] is True, done
    assert done["divergence"].startswith("diverged: the training loss ended at "), done["divergence"]
    assert "its first value 4." in done["divergence"] and "(step 1)" in done["divergence"]

    bad = stack.wait(failing["id"], statuses=("failed",))
    assert bad["diverged"] and bad["error"].endswith("train.fail_on_divergence is set"), bad["error"]
    assert bad["restarts"] == 0 and bad["attempts"] == 1  # the job's own failure: not retried

    ok = stack.wait(calm["id"])
    assert ok["diverged"] is False and ok["divergence"] is None

    listed = {j["id"]: j for j in stack.client.get("/api/jobs", params={"limit": 100}).json()["items"]}
    assert listed[flagged["id"]]["diverged"] and not listed[calm["id"]]["diverged"]

    shown = stack.cli("show", str(flagged["id"]))
    assert shown.returncode == 0, shown.stderr
    assert "diverged: the training loss ended at" in shown.stderr, shown.stderr
    assert '"diverged": true' in shown.stdout
    table = stack.cli("jobs", "--limit", "100")
    assert "succeeded (diverged)" in table.stdout, table.stdout
    # follow attached after the end still says it, after the result
    followed = stack.cli("follow", str(flagged["id"]))
    assert "diverged: the training loss ended at" in followed.stderr, followed.stderr
    assert "diverged" not in stack.cli("show", str(calm["id"])).stderr


def test_a_batch_flags_its_diverged_trial_and_says_which_stopped_early(stack: StackHandle) -> None:
    base = _with_train({**BLOWS_UP, "name": "facts"}, steps=12)
    body = grid_batch(
        "facts",
        base,
        {"train.lr": [3e-3, 1e-2, 10.0]},
        devices=2,
        early_stopping={"kind": "asha", "reduction_factor": 3, "min_steps": 4},
    )
    sel = stack.wait_selection(stack.submit_selection(body)["id"])
    assert sel["status"] == "succeeded", sel
    trials = {t["params"]["train.lr"]: t for t in sel["trials"]}
    jobs = {lr: stack.job(t["job_id"]) for lr, t in trials.items()}

    assert jobs[10.0]["diverged"] is True, jobs[10.0]
    assert jobs[3e-3]["diverged"] is False
    stopped = [lr for lr, t in trials.items() if t["stopped_early"]]
    assert stopped, "ASHA with reduction factor 3 over 3 trials stops some of them"
    for lr, t in trials.items():
        job = jobs[lr]
        # the job's status stays `succeeded` (the trial trained without fault); the fact is beside it
        assert job["status"] == "succeeded"
        assert job["stopped_early"] is t["stopped_early"]
        if t["stopped_early"]:
            assert job["stop_reason"]["rung"] == t["steps_done"], job["stop_reason"]
        else:
            assert job["stop_reason"] is None
    lr = stopped[0]
    shown = stack.cli("show", str(trials[lr]["job_id"]))
    assert shown.returncode == 0, shown.stderr
    assert "(succeeded): stopped early at the rung of step" in shown.stderr, shown.stderr
