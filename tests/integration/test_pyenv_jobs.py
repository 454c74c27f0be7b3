"""Bring your own dependencies, through the real stack: a workspace whose requirements.txt names a
small real package the project does not install (einops, from PyPI) trains a model that imports
it, in the warm trainer; a second job reuses the environment; two jobs at once build it once; a
package that does not exist fails its job naming it and the next job is unaffected; a pin that
replaces torch is refused at submit (env.pip) or at install (requirements.txt), naming the line;
a selection batch's trials share the base's environment."""

from __future__ import annotations

import fcntl
import importlib.util
import time
from pathlib import Path

import pytest

from jobrules.pyenv import accepted, requirements_digest
from tests.archives import targz
from tests.conftest import StackHandle
from tests.trainer.user_model_src import USER_MODEL
from workers.pyenv import platform_tag

pytestmark = pytest.mark.integration

EINLM = b'''
"""The user's model: the workspace's tiny LM with its mixing layers written with einops."""
import einops
from userlm.model import Mix, TinyLM


class EinMix(Mix):
    def forward(self, x):
        # time-major and back: every step runs einops, the package only the job's environment has
        return super().forward(einops.rearrange(einops.rearrange(x, "b t d -> t b d"), "t b d -> b t d"))


class EinLM(TinyLM):
    def build_layer(self, index):
        if 0 < index < self.n_layers - 1:
            return EinMix(self.width)
        return super().build_layer(index)


def make(*, vocab_size, width=32, depth=2):
    return EinLM(vocab_size=vocab_size, width=width, depth=depth)
'''

MODEL = {"kind": "python", "entry": "einlm:make", "args": {"width": 16}, "seq_len": 16}


def workspace(stack: StackHandle, requirements: str, name: str) -> str:
    body = targz(
        {
            "requirements.txt": requirements.encode(),
            "einlm.py": EINLM,
            "userlm/__init__.py": b"",
            "userlm/model.py": USER_MODEL.encode(),
        }
    )
    resp = stack.client.post(
        "/api/workspaces", params={"name": name}, content=body, headers={"content-type": "application/gzip"}
    )
    assert resp.status_code == 201, resp.text
    return resp.json()["ref"]


def spec(name: str, ref: str, steps: int = 6) -> dict:
    return {
        "name": name,
        "model": MODEL,
        "data": {"max_chars": 20_000},
        "train": {"steps": steps, "batch_size": 4, "eval_every": steps, "eval_batches": 1},
        "workspace": ref,
    }


def logs(stack: StackHandle, job_id: int) -> str:
    items = stack.client.get(f"/api/jobs/{job_id}/logs", params={"limit": 1000}).json()["items"]
    return "\n".join(e["message"] for e in items)


def test_workspace_requirements_train_and_the_next_job_reuses_them(stack: StackHandle) -> None:
    assert importlib.util.find_spec("einops") is None  # only the job's environment has it
    ref = workspace(stack, "# the model's own dependency\neinops==0.8.2\n", "einops-ws")
    first = stack.submit(spec("byod-first", ref))
    done = stack.wait(first["id"], timeout=300)
    assert done["result"]["params"] > 0 and done["wait_reason"] is None
    text = logs(stack, first["id"])
    assert "preparing environment" in text and "uv:  + einops==0.8.2" in text
    assert "installed einops==0.8.2" in text

    second = stack.submit(spec("byod-second", ref))
    stack.wait(second["id"], timeout=300)
    text2 = logs(stack, second["id"])
    assert "cached" in text2 and "preparing environment" not in text2 and "uv:" not in text2


def test_two_jobs_at_once_build_once(stack: StackHandle) -> None:
    ref = workspace(stack, "einops>=0.8,<0.9\n", "einops-range")  # a requirement no other test builds
    jobs = [stack.submit(spec(f"byod-together-{i}", ref)) for i in range(2)]
    for j in jobs:
        stack.wait(j["id"], timeout=300)
    texts = [logs(stack, j["id"]) for j in jobs]
    assert sum("ready in" in t for t in texts) == 1, texts
    assert sum("uv:  + einops" in t for t in texts) <= 2  # the dry run and the install of one build


def test_a_package_that_does_not_exist_fails_the_job_naming_it(stack: StackHandle) -> None:
    ref = workspace(stack, "einops==0.8.2\nshardyard-no-such-package-zzq==1.0\n", "missing-pkg")
    bad = stack.submit(spec("byod-missing", ref))
    failed = stack.wait(bad["id"], ("failed",), timeout=180)
    assert "shardyard-no-such-package-zzq" in failed["error"] and "not found" in failed["error"]
    assert "uv: error" in logs(stack, bad["id"])
    # the worker is unaffected: the next job trains
    ok = stack.submit({**spec("byod-after", ref), "workspace": None, "model": {"kind": "mlp", "layers": 1}})
    stack.wait(ok["id"], timeout=180)


def test_replacing_torch_is_refused_at_submit_naming_the_entry(stack: StackHandle) -> None:
    body = {
        **spec("byod-torch", "0"),
        "workspace": None,
        "model": {"kind": "mlp"},
        "env": {"pip": ["einops", "torch==2.5.0"]},
    }
    resp = stack.client.post("/api/jobs", json=body)
    assert resp.status_code == 422, resp.text
    detail = str(resp.json()["detail"])
    assert "env.pip[1]" in detail and "torch==2.5.0" in detail and "cannot be replaced" in detail
    opts = {**body, "env": {"pip": ["--extra-index-url https://example.com/simple"]}}
    resp = stack.client.post("/api/jobs", json=opts)
    assert (
        resp.status_code == 422 and "env.pip[0]" in str(resp.json()["detail"]) and "pip option" in resp.text
    )


def test_requirements_txt_lines_are_refused_at_install_naming_them(stack: StackHandle) -> None:
    ref = workspace(stack, "einops==0.8.2\nnumpy>=2\n-e ./mine\n", "numpy2")
    job = stack.submit(spec("byod-numpy2", ref))
    failed = stack.wait(job["id"], ("failed",), timeout=180)
    assert (
        "requirements.txt line 2 ('numpy>=2')" in failed["error"] and "cannot be replaced" in failed["error"]
    )
    assert "requirements.txt line 3 ('-e ./mine') is a pip option (-e)" in failed["error"]


def test_a_selection_batch_shares_the_base_environment(stack: StackHandle) -> None:
    ref = workspace(stack, "einops==0.8.2\n", "einops-sel")
    base = spec("byod-sel", ref, steps=4)
    resp = stack.client.post(
        "/api/selections",
        json={
            "name": "byod-widths",
            "base": base,
            "space": {"model.args.width": [8, 16]},
            "method": "grid",
            "devices": 1,
        },
    )
    assert resp.status_code == 201, resp.text
    sel = resp.json()
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        sel = stack.client.get(f"/api/selections/{sel['id']}").json()
        if sel["status"] in ("succeeded", "failed", "cancelled"):
            break
        time.sleep(0.5)
    assert sel["status"] == "succeeded", sel
    for t in sel["trials"]:
        assert "environment" in logs(stack, t["job_id"])


def test_a_job_waiting_on_a_build_shows_preparing_environment(stack: StackHandle) -> None:
    # this test holds the build lock of the job's environment, as another job's build would
    lines = "einops==0.8.1\n"
    key = requirements_digest(accepted([("1", "einops==0.8.1")]), platform=platform_tag())
    envs = Path(stack.stack.root) / "envs"
    envs.mkdir(exist_ok=True)
    ref = workspace(stack, lines, "einops-held")
    with open(envs / f"{key}.lock", "ab") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        job = stack.submit(spec("byod-held", ref))
        seen = stack.wait_until(job["id"], lambda j: j["wait_reason"] == "preparing environment", timeout=120)
        assert seen["status"] == "running"
        deadline = time.monotonic() + 60  # the log line comes through the relay's next flush
        while "another job is building it; waiting" not in logs(stack, job["id"]):
            assert time.monotonic() < deadline, logs(stack, job["id"])
            time.sleep(0.2)
        assert stack.job(job["id"])["wait_reason"] == "preparing environment"  # still, while held
    done = stack.wait(job["id"], timeout=300)
    assert done["wait_reason"] is None and "installed einops==0.8.1" in logs(stack, job["id"])


def test_a_selection_whose_environment_fails_fails_its_trials_naming_the_package(stack: StackHandle) -> None:
    base = {
        "name": "byod-sel-missing",
        "model": {"kind": "mlp", "layers": 1},
        "train": {"steps": 4, "batch_size": 4, "eval_every": 4, "eval_batches": 1},
        "env": {"pip": ["shardyard-no-such-package-zzq==1.0"]},
    }
    resp = stack.client.post(
        "/api/selections",
        json={"name": "byod-missing", "base": base, "space": {"train.lr": [1e-3, 3e-3]}, "method": "grid"},
    )
    assert resp.status_code == 201, resp.text
    sid = resp.json()["id"]
    deadline = time.monotonic() + 180
    while (sel := stack.client.get(f"/api/selections/{sid}").json())["status"] not in ("succeeded", "failed"):
        assert time.monotonic() < deadline, sel
        time.sleep(0.5)
    for t in sel["trials"]:
        job = stack.job(t["job_id"])
        assert job["status"] == "failed" and "shardyard-no-such-package-zzq" in job["error"], job
