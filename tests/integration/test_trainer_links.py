"""Links that hostile users' code plants in its own folder, through the real stack with the sandbox
on and a folder store that is not the data dir (so the worker uploads checkpoints): the worker
never reads or writes through them (core/safe_files.py, docs/security.md).

The model's first attempt plants a checkpoint-named link to a secret file outside every sandbox
bind, and links in place of `spec.json` and `stderr.log` to a canary file, waits for an upload,
then fails; an operator's requeue runs a second attempt, which trains to its end. The secret is
in no object of the store and not in the downloaded checkpoint, the canary is unchanged, and the
job's log names the refused checkpoint.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from pathlib import Path

import pytest

from api.stack import Stack
from tests.archives import targz
from tests.conftest import StackHandle, running
from tests.trainer.user_model_src import USER_MODEL

pytestmark = pytest.mark.integration

PLANTED = "step-00009999.pt"
PLANTER = (
    USER_MODEL
    + '''

import os
import time


def planter(*, vocab_size, secret_path, canary_path, width=32, depth=2):
    home = os.environ.get("HOME") or os.getcwd()
    mark = os.path.join(home, "planted-once")
    if not os.path.exists(mark):
        open(mark, "w").close()
        ckpt = os.path.join(home, "checkpoints")
        os.makedirs(ckpt, exist_ok=True)
        os.symlink(secret_path, os.path.join(ckpt, "'''
    + PLANTED
    + """"))
        for name in ("spec.json", "stderr.log"):
            tmp = os.path.join(home, name + ".planting")
            os.symlink(canary_path, tmp)
            os.replace(tmp, os.path.join(home, name))
        time.sleep(3)  # the worker's uploads run every half second meanwhile
        raise RuntimeError("links planted: this attempt ends here")
    return TinyLM(vocab_size=vocab_size, width=width, depth=depth)
"""
)


@pytest.fixture(scope="module")
def h(tmp_path_factory: pytest.TempPathFactory) -> Iterator[StackHandle]:
    root = tmp_path_factory.mktemp("links")
    env = {"SHARDYARD_STORAGE_URL": f"file://{root / 'store'}", "SHARDYARD_STORAGE_SYNC_S": "0.5"}
    st = Stack(root=root / "stack", workers=1, concurrency=1, extra_env=env)
    with running(st) as handle:
        yield handle


def test_planted_links_are_never_followed(h: StackHandle, tmp_path: Path) -> None:
    outside = tmp_path / "worker-only"  # no sandbox binds it: the links' targets exist only here
    outside.mkdir()
    secret = secrets.token_hex(24)
    (outside / "secret").write_text(secret)
    (outside / "canary").write_text("canary, unchanged\n")

    body = targz({"evil/__init__.py": b"", "evil/model.py": PLANTER.encode()})
    headers = {"content-type": "application/gzip"}
    ws = h.client.post("/api/workspaces", params={"name": "links"}, content=body, headers=headers).json()
    model = {
        "kind": "python",
        "entry": "evil.model:planter",
        "args": {"secret_path": str(outside / "secret"), "canary_path": str(outside / "canary")},
        "seq_len": 16,
    }
    spec = {
        "name": "links",
        "model": model,
        "workspace": ws["ref"],
        "data": {"max_chars": 100_000},
        "train": {"steps": 12, "batch_size": 8, "lr": 3e-3, "eval_every": 12},
    }
    job = h.client.post("/api/jobs", json=spec).json()
    assert "id" in job, job
    first = h.wait(job["id"], ("failed",), timeout=120)
    assert first["status"] == "failed", first
    assert h.client.get("/api/health").json()["sandbox"] == "on"
    r = h.client.post(f"/api/jobs/{job['id']}/requeue", json={"reason": "second attempt"})
    assert r.status_code == 200, r.text
    done = h.wait(job["id"], timeout=120)
    assert done["status"] == "succeeded", done
    assert done["attempts"] == 2

    # the secret is in no object of the store, and the download is the job's own checkpoint
    store = Path(h.stack.root).parent / "store"
    objects = [p for p in store.rglob("*") if p.is_file()]
    assert any(p.name.startswith("step-") for p in objects), objects
    assert not [p for p in objects if secret.encode() in p.read_bytes()]
    assert not any(p.name == PLANTED for p in objects)
    got = h.client.get(f"/api/jobs/{job['id']}/checkpoint")
    assert got.status_code == 200 and secret.encode() not in got.content
    # nothing was written through the links: not the spec, not the stderr log
    assert (outside / "canary").read_text() == "canary, unchanged\n"
    assert (outside / "secret").read_text() == secret
    folder = Path(h.stack.root) / "jobs" / str(job["id"])
    assert not (folder / "spec.json").is_symlink() and not (folder / "stderr.log").is_symlink()
    logs = "\n".join(
        e["message"]
        for e in h.client.get(f"/api/jobs/{job['id']}/logs", params={"limit": 1000}).json()["items"]
    )
    assert f"checkpoints/{PLANTED} is a symbolic link: not uploaded" in logs, logs[-3000:]
