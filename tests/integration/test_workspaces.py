"""Workspaces through the real stack: archives uploaded over HTTP (and packed by the CLI), checked
and stored by digest, unpacked by the worker into the job folder and put on the trainer's import
path; the user's data (UTF-8 text with a tokenizers JSON file trained here, a python entry point)
trains to a falling loss; malicious archives and broken entry points are refused with the reason."""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path

import pytest

from tests.archives import MALICIOUS, targz, upload
from tests.conftest import TERMINAL, StackHandle
from tests.trainer.user_model_src import USER_MODEL
from tests.user_data import PERIODIC_BATCHES_PY
from workers.spare import unpacked_workspace

pytestmark = pytest.mark.integration

TEXT = "It was the best of times, it was the worst of times, it was the age of wisdom.\n"

DATA_PY = (
    PERIODIC_BATCHES_PY
    + b"""
def broken(**kwargs):
    return helper_that_does_not_exist(kwargs)
"""
)


def tiny(**over) -> dict:  # noqa: ANN003
    spec = {
        "name": "ws",
        "model": {"kind": "gpt", "layers": 1, "d_model": 32, "heads": 2, "seq_len": 16},
        "train": {"steps": 30, "batch_size": 8, "lr": 3e-3, "eval_every": 30},
    }
    return {**spec, **over}


def falls(stack: StackHandle, job_id: int) -> bool:
    loss = stack.client.get(f"/api/jobs/{job_id}/metrics", params={"names": "loss"}).json()["series"]["loss"]
    v = loss["values"]
    return sum(v[-5:]) / 5 < sum(v[:5]) / 5 - 0.3


@pytest.mark.parametrize("case", sorted(MALICIOUS))
def test_malicious_archives_are_refused_with_the_reason(stack: StackHandle, case: str) -> None:
    data, reason = MALICIOUS[case]
    resp = upload(stack, data, name=case)
    assert resp.status_code == 422, resp.text
    assert reason in resp.json()["detail"]
    names = [w["name"] for w in stack.client.get("/api/workspaces").json()["items"]]
    assert case not in names


def test_upload_is_content_addressed_listed_and_deletable(stack: StackHandle) -> None:
    body = targz({"hello.txt": b"hello " * 1000})
    first = upload(stack, body, name="hello")
    assert first.status_code == 201, first.text
    ws = first.json()
    assert ws["digest"] == hashlib.sha256(body).hexdigest() and ws["size"] == len(body)
    assert ws["format"] == "tar.gz" and ws["ref"] == f"sha256:{ws['digest']}"
    again = upload(stack, body, name="hello-again").json()
    assert again["id"] == ws["id"], "the same bytes are the same workspace"
    assert stack.client.get(f"/api/workspaces/{ws['ref']}").json()["id"] == ws["id"]
    assert ws["id"] in [w["id"] for w in stack.client.get("/api/workspaces").json()["items"]]

    assert stack.client.delete(f"/api/workspaces/{ws['id']}").status_code == 204
    assert stack.client.get(f"/api/workspaces/{ws['id']}").status_code == 404
    resp = stack.client.post("/api/jobs", json=tiny(workspace=str(ws["id"])))
    assert resp.status_code == 422 and f"workspace {ws['id']} not found" in resp.json()["detail"]
    resp = stack.client.post("/api/jobs", json=tiny(data={"path": "corpus.txt"}))
    assert resp.status_code == 422 and "data.path ('corpus.txt') is relative" in resp.json()["detail"]
    assert upload(stack, b"").status_code == 422


def test_user_text_and_tokenizer_from_the_workspace_train(stack: StackHandle, tmp_path: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    folder = tmp_path / "project"
    folder.mkdir()
    (folder / "corpus.txt").write_text(TEXT * 400)
    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train([str(folder / "corpus.txt")], trainers.BpeTrainer(vocab_size=280, special_tokens=["[UNK]"]))
    tok.save(str(folder / "tokenizer.json"))
    (folder / "__pycache__").mkdir()
    (folder / "__pycache__" / "junk.pyc").write_bytes(b"\0")
    spec = tmp_path / "job.json"
    spec.write_text(json.dumps(tiny(name="bpe", data={"path": "corpus.txt", "tokenizer": "tokenizer.json"})))

    out = stack.cli("submit", str(spec), "--workspace", str(folder), timeout=120)
    assert out.returncode == 0, out.stderr
    job_id = int(out.stdout.split("submitted job", 1)[1].split()[0])
    job = stack.wait(job_id, timeout=180)
    assert job["spec"]["workspace"].startswith("sha256:")
    assert falls(stack, job_id)
    unpacked = unpacked_workspace(Path(stack.stack.root) / "jobs" / str(job_id))
    assert (unpacked / "tokenizer.json").is_file() and not (unpacked / "__pycache__").exists()


def test_python_data_entry_point_and_a_broken_one(stack: StackHandle) -> None:
    ws = upload(stack, targz({"mydata/__init__.py": b"", "mydata/source.py": DATA_PY})).json()
    data = {"kind": "python", "entry": "mydata.source:batches", "args": {"period": 13}, "vocab_size": 13}
    good = stack.submit(tiny(name="pydata", data=data, workspace=ws["ref"]))
    broken = stack.submit(
        tiny(name="broken", data={**data, "entry": "mydata.source:broken"}, workspace=str(ws["id"]))
    )
    stack.wait(good["id"], timeout=180)
    assert falls(stack, good["id"])

    failed = stack.wait(broken["id"], ("failed",), timeout=180)
    assert "user code failed: data.entry" in failed["error"]
    assert "NameError" in failed["error"] and "helper_that_does_not_exist" in failed["error"]
    logs = "\n".join(e["message"] for e in stack.client.get(f"/api/jobs/{broken['id']}/logs").json()["items"])
    assert 'mydata/source.py", line 14, in broken' in logs  # the user's own frame, in the job's logs


def test_user_model_trains_through_the_api_and_a_selection_ranges_over_its_args(stack: StackHandle) -> None:
    ws = upload(stack, targz({"userlm/__init__.py": b"", "userlm/model.py": USER_MODEL.encode()})).json()
    model = {"kind": "python", "entry": "userlm.model:make", "args": {"width": 32}, "seq_len": 16}
    job = stack.submit(tiny(name="user-model", model=model, data={"max_chars": 100_000}, workspace=ws["ref"]))
    broken = stack.submit(
        tiny(
            name="user-broken",
            model={**model, "entry": "userlm.model:mismatched", "args": {}},
            workspace=ws["ref"],
        )
    )
    done = stack.wait(job["id"], timeout=180)
    assert falls(stack, job["id"]) and done["result"]["params"] > 0
    failed = stack.wait(broken["id"], ("failed",), timeout=180)
    assert "layer 1 (Linear) failed on an input of shape" in failed["error"]
    logs = "\n".join(e["message"] for e in stack.client.get(f"/api/jobs/{broken['id']}/logs").json()["items"])
    assert "traceback of the user's code" in logs and "must have same reduction dim" in logs

    body = {
        "name": "user-widths",
        "base": tiny(
            name="sel",
            model=model,
            workspace=str(ws["id"]),
            train={"steps": 12, "batch_size": 8, "lr": 3e-3, "eval_every": 4},
        ),
        "space": {"model.args.width": [8, 16, 24, 32, 40, 48]},
        "method": "grid",
        "devices": 2,
        "early_stopping": {"kind": "asha", "reduction_factor": 3, "min_steps": 4},
    }
    sid = stack.submit_selection(body)["id"]
    deadline = time.monotonic() + 300
    while (sel := stack.client.get(f"/api/selections/{sid}").json())["status"] not in TERMINAL:
        assert time.monotonic() < deadline, sel
        time.sleep(0.5)
    assert sel["status"] == "succeeded", sel
    assert sorted(t["params"]["model.args.width"] for t in sel["trials"]) == [8, 16, 24, 32, 40, 48]
    assert all(t["status"] in ("succeeded", "stopped_early") for t in sel["trials"])
    assert any(t["stopped_early"] for t in sel["trials"]), "ASHA stops some of six trials"
    widths = {stack.job(t["job_id"])["spec"]["model"]["args"]["width"] for t in sel["trials"]}
    assert widths == {8, 16, 24, 32, 40, 48}


def test_workspaces_belong_to_their_uploader(stack: StackHandle) -> None:
    from tests.integration.test_auth import new_user

    body = targz({"mine.txt": b"alice's code"})
    _a, ca = new_user(stack)
    _b, cb = new_user(stack)
    with ca, cb:
        headers = {"content-type": "application/gzip"}
        mine = ca.post("/api/workspaces", params={"name": "a"}, content=body, headers=headers).json()
        assert [w["id"] for w in ca.get("/api/workspaces").json()["items"]] == [mine["id"]]
        # B sees nothing of A's: not listed, not by id or digest, not usable in a job, not deletable
        assert cb.get("/api/workspaces").json()["total"] == 0
        assert cb.get(f"/api/workspaces/{mine['id']}").status_code == 404
        assert cb.get(f"/api/workspaces/{mine['ref']}").status_code == 404
        resp = cb.post("/api/jobs", json=tiny(workspace=mine["ref"]))
        assert resp.status_code == 422 and "not found" in resp.json()["detail"]
        assert cb.delete(f"/api/workspaces/{mine['id']}").status_code == 404
        # the same bytes uploaded by B are B's own workspace (one stored file)
        theirs = cb.post("/api/workspaces", params={"name": "b"}, content=body, headers=headers).json()
        assert theirs["id"] != mine["id"] and theirs["digest"] == mine["digest"]
        assert cb.delete(f"/api/workspaces/{theirs['id']}").status_code == 204
        assert ca.get(f"/api/workspaces/{mine['ref']}").json()["id"] == mine["id"]
        blob = Path(stack.stack.root) / "workspaces" / f"{mine['digest']}.tar.gz"
        assert blob.is_file(), "A's row still needs the stored file"
        assert ca.delete(f"/api/workspaces/{mine['id']}").status_code == 204
        assert not blob.exists()
