"""Users' code in its sandbox, through the real stack (workers/sandbox.py, docs/security.md).

A hostile workspace's model entry point tries every escape: the worker's credentials in its
environment and in other processes' /proc environ, signals to the API and the workers, the SQLite
file, the data dir, another user's job folder, the stored archives, the environment cache, the
project's code, Redis and the API over loopback, home folders and /etc/shadow. It prints what it
reached; its job must still train to its end and reach nothing. While it trains, it prints dots
without newlines and fake protocol lines, which must change no metric and no status.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.archives import targz
from tests.conftest import StackHandle
from tests.hostile_src import HOSTILE, hostile_report
from tests.integration.test_auth import new_user
from trainer.zygote import SPARE_MARK

pytestmark = pytest.mark.integration

STEPS = 24


def spec(**over) -> dict:  # noqa: ANN003
    base = {
        "name": "sandboxed",
        "model": {"kind": "gpt", "layers": 1, "d_model": 32, "heads": 2, "seq_len": 16},
        "data": {"max_chars": 100_000},
        "train": {"steps": STEPS, "batch_size": 8, "lr": 3e-3, "eval_every": STEPS},
    }
    return {**base, **over}


def test_a_hostile_workspace_trains_and_reaches_nothing(stack: StackHandle) -> None:
    st = stack.stack
    # another user's finished job: its folder is on this worker's disk
    _b, cb = new_user(stack)
    _a, ca = new_user(stack)
    with ca, cb:
        other = cb.post("/api/jobs", json=spec(name="victim")).json()
        stack.wait(other["id"], timeout=180)
        root = Path(st.root)
        assert (root / "jobs" / str(other["id"]) / "spec.json").is_file()
        targets = {
            "pids": [p.pid for p in st.procs.values()] + [os.getpid()],
            "database": st.database_url.removeprefix("sqlite:///"),
            "data_dir": str(root),
            "other_job": str(root / "jobs" / str(other["id"]) / "spec.json"),
            "archives": str(root / "workspaces"),
            "env_cache": str(root / "envs"),
            "code": str(Path(__file__).resolve().parents[2] / "trainer"),
            "redis_port": st.redis_port,
            "api_port": st.api_port,
        }
        headers = {"content-type": "application/gzip"}
        body = targz({"evil/__init__.py": b"", "evil/model.py": HOSTILE.encode()})
        ws = ca.post("/api/workspaces", params={"name": "evil"}, content=body, headers=headers).json()
        model = {"kind": "python", "entry": "evil.model:hostile", "args": {"targets": targets}, "seq_len": 16}
        job = ca.post("/api/jobs", json=spec(name="hostile", model=model, workspace=ws["ref"])).json()
        assert "id" in job, job
        done = stack.wait(job["id"], timeout=240)

    assert stack.client.get("/api/health").json()["sandbox"] == "on"
    # it ran as a sandboxed run starts by default: from its pool process's spare, made ahead
    # (workers/spare.py; the cold sandbox's policy is the same, tests/unit/test_sandbox.py)
    stderr = (Path(st.root) / "jobs" / str(job["id"]) / "stderr.log").read_text()
    assert SPARE_MARK in stderr, stderr[-2000:]
    report = hostile_report(stack.client, job["id"])
    reached = {k: v for k, v in report.items() if not v.startswith("blocked")}
    assert not reached, f"the sandbox let users' code reach: {reached}"
    assert len(report) == 15, report

    # the dots and the fake protocol lines are its log, nothing more: every real loss step once
    loss = stack.client.get(f"/api/jobs/{job['id']}/metrics", params={"names": "loss"}).json()["series"][
        "loss"
    ]
    assert loss["steps"] == list(range(1, STEPS + 1))
    assert min(loss["values"]) > 0, "a printed fake loss became a metric"
    assert done["result"]["final_loss"] > 0
    logs = "\n".join(
        e["message"]
        for e in stack.client.get(f"/api/jobs/{job['id']}/logs", params={"limit": 1000}).json()["items"]
    )
    assert '"value": -124.0' in logs and "..." in logs  # what it printed is in its log


def test_the_project_code_and_service_files_are_untouched(stack: StackHandle) -> None:
    # after the hostile job (same module stack): nothing it tried to plant exists on the host
    root = Path(stack.stack.root)
    code = Path(__file__).resolve().parents[2]
    assert not (code / "trainer" / "planted.py").exists()
    assert not (root / "envs" / "planted.pth").exists()


def test_a_stored_archive_changed_after_upload_is_refused(stack: StackHandle) -> None:
    # the archive's bytes are checked against its digest before every unpack: a stored file
    # swapped for other code (by whoever could write the store) never runs
    from tests.user_data import PERIODIC_BATCHES_PY

    body = targz({"mydata/__init__.py": b"", "mydata/source.py": PERIODIC_BATCHES_PY + b"\n# swap me\n"})
    headers = {"content-type": "application/gzip"}
    ws = stack.client.post(
        "/api/workspaces", params={"name": "swapped"}, content=body, headers=headers
    ).json()
    stored = Path(stack.stack.root) / "workspaces" / f"{ws['digest']}.tar.gz"
    assert stored.is_file()
    stored.write_bytes(targz({"mydata/__init__.py": b"raise SystemExit('planted code ran')\n"}))
    data = {"kind": "python", "entry": "mydata.source:batches", "args": {"period": 13}, "vocab_size": 13}
    job = stack.submit(spec(name="swapped", data=data, workspace=ws["ref"]))
    failed = stack.wait(job["id"], ("failed",), timeout=180)
    assert "do not match its digest" in failed["error"], failed["error"]
