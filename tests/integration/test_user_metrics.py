"""A user's own metrics through the real stack: a workspace model that reports `accuracy`
(trainer/report.py) trains as a job and as a selection batch's trials; the metrics endpoint serves
every step's value once, the batch ranks by `accuracy` (mode max) and puts the most accurate trial
first, and bad metric names are refused at submit naming the field and the rule."""

from __future__ import annotations

import io
from typing import Any

import pytest
import torch

from tests.archives import targz, upload
from tests.conftest import StackHandle
from tests.trainer.user_metrics_src import USER_METRICS

pytestmark = pytest.mark.integration


def spec(ws: str, **train: Any) -> dict[str, Any]:
    return {
        "name": "scored",
        "workspace": ws,
        "model": {"kind": "python", "entry": "scored:scored", "args": {"width": 8}},
        "data": {"kind": "python", "entry": "scored:labelled_images"},
        "train": {"steps": 12, "batch_size": 16, "lr": 1e-2, "eval_every": 4, "eval_batches": 2, **train},
    }


@pytest.fixture(scope="module")
def workspace(stack: StackHandle) -> str:
    resp = upload(stack, targz({"scored.py": USER_METRICS.encode()}), name="scored")
    assert resp.status_code == 201, resp.text
    return resp.json()["ref"]


def test_a_workspace_model_reports_accuracy_once_per_step(stack: StackHandle, workspace: str) -> None:
    job = stack.submit(spec(workspace))
    stack.wait(job["id"], timeout=180)
    got = stack.client.get(
        f"/api/jobs/{job['id']}/metrics", params={"names": "accuracy,val_accuracy,loss,data/class0"}
    ).json()["series"]
    steps = list(range(1, 13))
    assert got["loss"]["steps"] == steps
    assert got["accuracy"]["steps"] == steps and got["data/class0"]["steps"] == steps
    assert got["val_accuracy"]["steps"] == [4, 8, 12]
    assert all(0.0 <= v <= 1.0 for v in got["accuracy"]["values"])
    # the names a job reported are among those the metrics endpoint lists
    everything = stack.client.get(f"/api/jobs/{job['id']}/metrics").json()["series"]
    assert {"accuracy", "val_accuracy", "data/class0"} <= set(everything)


def test_a_selection_ranks_its_trials_by_accuracy(stack: StackHandle, workspace: str) -> None:
    body = {
        "name": "by-accuracy",
        "base": spec(workspace, steps=8),
        "space": {"train.lr": [3e-2, 1e-2, 1e-4]},
        "method": "grid",
        "devices": 2,
        "metric": "accuracy",
        "mode": "max",
    }
    sel = stack.wait_selection(stack.submit_selection(body)["id"], timeout=300)
    assert sel["status"] == "succeeded", sel
    assert sel["metric"] == "accuracy" and sel["mode"] == "max"
    best: dict[int, float] = {}
    for t in sel["trials"]:
        series = stack.client.get(f"/api/jobs/{t['job_id']}/metrics", params={"names": "accuracy"}).json()
        values = series["series"]["accuracy"]["values"]
        assert series["series"]["accuracy"]["steps"] == list(range(1, 9))
        best[t["id"]] = max(values)
        assert t["best_metric"] == pytest.approx(max(values))
    # best first (ties in either order); the first is a trial with the highest accuracy of all
    ranked = [best[tid] for tid in sel["leaderboard"]]
    assert sorted(sel["leaderboard"]) == sorted(best) and ranked == sorted(ranked, reverse=True)
    assert ranked[0] == max(best.values()) and ranked[0] > min(best.values())

    # the best trial's weights: its job's checkpoint (the batch keeps only the best trial's)
    jobs = {t["id"]: t["job_id"] for t in sel["trials"]}
    resp = stack.client.get(f"/api/jobs/{jobs[sel['leaderboard'][0]]}/checkpoint")
    assert resp.status_code == 200, resp.text
    assert resp.headers["content-disposition"].endswith('-step-8.pt"')
    state = torch.load(io.BytesIO(resp.content), weights_only=True)
    assert state["model"] and all(isinstance(t, torch.Tensor) for t in state["model"].values())
    resp = stack.client.get(f"/api/jobs/{jobs[sel['leaderboard'][-1]]}/checkpoint")
    assert resp.status_code == 404 and "keeps only its best trial's checkpoint" in resp.text, resp.text
    # the CLI's leaderboard names the best trial's job, and how to download its weights
    shown = stack.cli("selection", "show", str(sel["id"]))
    assert shown.returncode == 0, shown.stderr
    assert f"shardyard download {jobs[sel['leaderboard'][0]]}" in shown.stdout


@pytest.mark.parametrize(
    ("metric", "rule"),
    [
        ("hw.cpu_pct", "hardware samples"),
        ("step_time_ms", "the trainer's own"),
        ("2nd", "must match"),
        ("x" * 65, "at most 64 characters"),
    ],
)
def test_bad_metric_names_are_refused_at_submit(
    stack: StackHandle, workspace: str, metric: str, rule: str
) -> None:
    body = {"base": spec(workspace), "space": {"train.lr": [1e-2]}, "metric": metric, "mode": "max"}
    resp = stack.client.post("/api/selections", json=body)
    assert resp.status_code == 422, resp.text
    assert "metric" in resp.text and rule in resp.text


def test_a_user_metric_needs_user_code(stack: StackHandle) -> None:
    base = {"model": {"kind": "gpt", "layers": 1, "d_model": 16, "heads": 2, "seq_len": 16}}
    body = {"base": base, "space": {"train.lr": [1e-2]}, "metric": "accuracy", "mode": "max"}
    resp = stack.client.post("/api/selections", json=body)
    assert resp.status_code == 422, resp.text
    assert "only a workspace's own code reports" in resp.text
