"""A job's trained weights through the real stack: `GET /api/jobs/{id}/checkpoint` streams the
newest whole checkpoint from the store with a filename, the SDK (`Job.download`) and the CLI
(`shardyard download`) write it to a file, and `torch.load(weights_only=True)` reads it: the same
tensors as the same job trained here in-process, the loop's result that the API reported. Another
user learns nothing of it (404); a job with none, or with checkpoints in pieces, answers 404 with
the reason."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from shardyard.client import Client
from shardyard.errors import ApiError
from tests.conftest import StackHandle, checkpointed_job, long_job
from tests.integration.test_auth import new_user
from trainer.checkpoint import latest_checkpoint, load_checkpoint
from trainer.config import load_job
from trainer.protocol import ListSink, NeverStop
from trainer.runner import run

pytestmark = pytest.mark.integration

SPEC: dict[str, Any] = checkpointed_job("take-home", steps=10, every=5)


def test_download_a_finished_jobs_weights(stack: StackHandle, tmp_path: Path) -> None:
    job_id = stack.submit(SPEC)["id"]
    done = stack.wait(job_id, timeout=180)

    resp = stack.client.get(f"/api/jobs/{job_id}/checkpoint")
    assert resp.status_code == 200, resp.text
    assert resp.headers["content-disposition"] == f'attachment; filename="job-{job_id}-step-10.pt"'
    assert int(resp.headers["content-length"]) == len(resp.content)
    info = stack.client.get(f"/api/jobs/{job_id}/checkpoint/info").json()
    assert info == {
        "job_id": job_id,
        "step": 10,
        "size": len(resp.content),
        "filename": f"job-{job_id}-step-10.pt",
        "format": "pt",
        "best": False,
        "metric": None,
        "value": None,
    }

    with Client(stack.base_url, stack.token) as sy:
        path = sy.get(job_id).download(tmp_path)
    assert path == tmp_path / f"job-{job_id}-step-10.pt" and path.read_bytes() == resp.content
    state = torch.load(path, weights_only=True)
    assert state["loop"]["result"]["final_loss"] == done["result"]["final_loss"]

    # the same job trained here: the same parameter names, shapes and values
    here = tmp_path / "here"
    run(load_job(SPEC), sink=ListSink(), stop=NeverStop(), checkpoint_dir=here)
    ref = load_checkpoint(latest_checkpoint(here))["model"]
    assert sorted(state["model"]) == sorted(ref)
    for name, t in ref.items():
        assert state["model"][name].shape == t.shape, name
        torch.testing.assert_close(state["model"][name], t, rtol=1e-4, atol=1e-5, msg=name)

    # the CLI: a file of the caller's choosing
    out = tmp_path / "cli" / "weights.pt"
    out.parent.mkdir()
    proc = stack.cli("download", str(job_id), "-o", str(out), timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert out.read_bytes() == resp.content and "wrote" in proc.stdout

    # another user: no such job
    _, other = new_user(stack)
    with other:
        for path in ("checkpoint", "checkpoint/info"):
            resp = other.get(f"/api/jobs/{job_id}/{path}")
            assert resp.status_code == 404 and f"job {job_id} does not exist" in resp.json()["detail"]


def test_no_whole_checkpoint_is_a_404_with_the_reason(stack: StackHandle, tmp_path: Path) -> None:
    waiting = stack.submit({**long_job("not-yet", 2000, checkpoint_every=1000), "priority": -5})
    piped = stack.submit(
        {**SPEC, "name": "pieces", "parallel": {"pipeline": {"stages": 2, "microbatches": 2}}}
    )
    try:
        resp = stack.client.get(f"/api/jobs/{waiting['id']}/checkpoint")
        assert resp.status_code == 404, resp.text
        assert f"job {waiting['id']} has no checkpoint yet" in resp.json()["detail"]
        assert "every 1000 steps and at its end" in resp.json()["detail"]
        resp = stack.client.get(f"/api/jobs/{piped['id']}/checkpoint")
        assert resp.status_code == 404 and "in 2 pieces" in resp.json()["detail"], resp.text
        info = stack.client.get(f"/api/jobs/{waiting['id']}/checkpoint/info")
        assert info.status_code == 404 and "has no checkpoint yet" in info.json()["detail"]
        with Client(stack.base_url, stack.token) as sy, pytest.raises(ApiError) as err:
            sy.download(waiting["id"], tmp_path / "none.pt")
        assert err.value.status == 404 and "no checkpoint yet" in str(err.value)
        assert not list(tmp_path.iterdir())  # nothing written, not even a partial file
    finally:
        for j in (waiting, piped):
            stack.client.post(f"/api/jobs/{j['id']}/cancel")
