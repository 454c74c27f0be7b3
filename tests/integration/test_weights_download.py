"""A job's weights as safetensors and its best checkpoint, through the real stack (the local
disk store; tests/integration/test_storage_s3.py does the same on moto's S3): `format=safetensors`
streams the checkpoint's "model" tensors, converted without torch in the API (api/weights.py),
and the bytes load into the recipe's own model; `best=true` picks the checkpoint at the best
val_loss step; a batch's best trial comes from GET /api/selections/{id}/checkpoint, the SDK and
`shardyard download --selection`. Owner-only; a bad format is a 422 naming it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load as load_safetensors
from safetensors.torch import load_file

from shardyard.client import Client
from tests.conftest import StackHandle, checkpointed_job, grid_batch
from tests.integration.test_auth import new_user
from trainer.config import load_job
from trainer.models import build_model

pytestmark = pytest.mark.integration

SPEC: dict[str, Any] = checkpointed_job("weights", steps=12, every=4)


def check_weights(spec: dict[str, Any], weights: dict[str, torch.Tensor], pt_bytes: bytes, tmp: Path) -> None:
    """`weights` are the checkpoint's model tensors, and the recipe's own model takes them."""
    tmp.write_bytes(pt_bytes)
    ref = torch.load(tmp, weights_only=True)["model"]
    assert sorted(weights) == sorted(ref)
    for name, t in ref.items():
        assert weights[name].dtype == t.dtype and weights[name].shape == t.shape, name
        assert torch.equal(weights[name], t), name
    model = build_model(load_job(spec).model, seed=0)
    model.load_state_dict(weights, strict=True)
    assert torch.equal(model.state_dict()[next(iter(ref))], next(iter(ref.values())))


def _val_losses(stack: StackHandle, job_id: int) -> dict[int, float]:
    got = stack.client.get(f"/api/jobs/{job_id}/metrics", params={"names": "val_loss"}).json()
    series = got["series"]["val_loss"]
    return dict(zip(series["steps"], series["values"], strict=True))


def test_a_jobs_weights_as_safetensors_and_its_best_checkpoint(stack: StackHandle, tmp_path: Path) -> None:
    job_id = stack.submit(SPEC)["id"]
    stack.wait(job_id, timeout=180)

    pt = stack.client.get(f"/api/jobs/{job_id}/checkpoint")
    assert pt.status_code == 200 and pt.headers["x-checkpoint-step"] == "12"
    resp = stack.client.get(f"/api/jobs/{job_id}/checkpoint", params={"format": "safetensors"})
    assert resp.status_code == 200, resp.text
    assert resp.headers["content-disposition"] == f'attachment; filename="job-{job_id}-step-12.safetensors"'
    assert int(resp.headers["content-length"]) == len(resp.content)
    check_weights(SPEC, load_safetensors(resp.content), pt.content, tmp_path / "newest.pt")
    info = stack.client.get(f"/api/jobs/{job_id}/checkpoint/info", params={"format": "safetensors"}).json()
    assert info["size"] == len(resp.content) and info["format"] == "safetensors", info

    # best: the kept checkpoint at the lowest val_loss (checkpoints and evaluations at 4, 8, 12)
    vals = _val_losses(stack, job_id)
    want = min(vals, key=lambda st: (vals[st], -st))
    best = stack.client.get(f"/api/jobs/{job_id}/checkpoint", params={"best": "true"})
    assert best.status_code == 200 and best.headers["x-checkpoint-step"] == str(want), (vals, best.headers)
    info = stack.client.get(f"/api/jobs/{job_id}/checkpoint/info", params={"best": "true"}).json()
    assert info["best"] and info["metric"] == "val_loss" and info["step"] == want
    assert info["value"] == pytest.approx(vals[want])

    # the SDK and the CLI, both options at once
    with Client(stack.base_url, stack.token) as sy:
        path = sy.get(job_id).download(tmp_path, best=True, format="safetensors")
    assert path.name == f"job-{job_id}-step-{want}.safetensors"
    out = tmp_path / "cli"
    out.mkdir()
    proc = stack.cli("download", str(job_id), "--best", "--safetensors", "-o", str(out), timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert (out / path.name).read_bytes() == path.read_bytes()
    check_weights(SPEC, load_file(path), best.content, tmp_path / "best.pt")

    # bad input and another user
    bad = stack.client.get(f"/api/jobs/{job_id}/checkpoint", params={"format": "onnx"})
    assert bad.status_code == 422 and "format" in bad.text, bad.text
    _, other = new_user(stack)
    with other:
        for path_ in ("checkpoint", "checkpoint/info"):
            resp = other.get(f"/api/jobs/{job_id}/{path_}", params={"format": "safetensors"})
            assert resp.status_code == 404 and f"job {job_id} does not exist" in resp.json()["detail"]


def test_a_batch_s_best_trial_in_one_call(stack: StackHandle, tmp_path: Path) -> None:
    base = {**SPEC, "name": "best-of", "checkpoint_every": 0, "train": {**SPEC["train"], "steps": 8}}
    body = grid_batch("best-of", base, {"train.lr": [1e-4, 3e-3]}, devices=2)
    sel = stack.wait_selection(stack.submit_selection(body)["id"])
    assert sel["status"] == "succeeded", sel
    best_trial = next(t for t in sel["trials"] if t["id"] == sel["leaderboard"][0])

    resp = stack.client.get(f"/api/selections/{sel['id']}/checkpoint", params={"format": "safetensors"})
    assert resp.status_code == 200, resp.text
    assert resp.headers["x-job-id"] == str(best_trial["job_id"])
    pt = stack.client.get(f"/api/jobs/{best_trial['job_id']}/checkpoint")
    trial_spec = stack.job(best_trial["job_id"])["spec"]
    check_weights(trial_spec, load_safetensors(resp.content), pt.content, tmp_path / "trial.pt")

    with Client(stack.base_url, stack.token) as sy:
        got = sy.get_selection(sel["id"]).download(tmp_path)
    assert got.read_bytes() == pt.content
    proc = stack.cli("download", "--selection", str(sel["id"]), "-o", str(tmp_path / "cli.pt"))
    assert proc.returncode == 0 and "best trial" in proc.stdout, proc.stderr
    assert (tmp_path / "cli.pt").read_bytes() == pt.content

    _, other = new_user(stack)
    with other:
        resp = other.get(f"/api/selections/{sel['id']}/checkpoint")
        assert resp.status_code == 404 and "does not exist" in resp.json()["detail"]
