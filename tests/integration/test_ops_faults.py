"""Faults injected while a job trains, on a stack of this module's own (the faults would disturb
the shared one): redis-server restarted with a stream and `shardyard follow` open, the API
restarted under `shardyard follow`, a full disk under the job's checkpoints; and checkpoint
pruning and deletion of a real finished job."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import update

from api.schemas import JobSpec
from api.stack import Stack
from db.connection import session_for
from db.jobs import create_job
from db.models import User
from db.users import create_user
from jobrules.applied import APPLIED_FILE
from tests.conftest import StackHandle, grid_batch, long_job, running
from tests.fullfs import full_disk
from tests.sse import read_sse
from tests.user_data import held_data, upload_held

pytestmark = pytest.mark.integration

# fast steps (a one-layer MLP), so a job of a few hundred steps lasts seconds, not minutes
FAST = {
    "name": "fast",
    "model": {"kind": "mlp", "layers": 1, "d_model": 16, "seq_len": 8},
    "data": {"max_chars": 20_000},
    "train": {"steps": 100, "batch_size": 2, "eval_every": 50, "eval_batches": 1},
}


@pytest.fixture(scope="module")
def ops_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[StackHandle]:
    st = Stack(root=tmp_path_factory.mktemp("ops"), workers=1, extra_env={"SHARDYARD_SSE_KEEPALIVE_S": "1"})
    with running(st) as handle:
        yield handle


def _follow(handle: StackHandle, job_id: int) -> subprocess.Popen[str]:
    env = {
        **os.environ,
        "SHARDYARD_API_URL": handle.base_url,
        "SHARDYARD_TOKEN": handle.token,
        "COLUMNS": "200",
    }
    return subprocess.Popen(
        [sys.executable, "-m", "api.cli", "follow", str(job_id)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )


def _connected(h: StackHandle, timeout: float = 120) -> None:
    """Waits until the API counts an open stream (GET /metrics): the follow has started and opened
    its stream. On a loaded machine the CLI's start can outlast the wait for step 10, and a restart
    before it connects would test nothing."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        r = httpx.get(f"{h.base_url}/metrics", headers={"Authorization": f"Bearer {h.token}"}, timeout=30)
        assert r.status_code == 200, r.text
        for family in text_string_to_metric_families(r.text):
            if family.name == "shardyard_sse_open_streams" and sum(x.value for x in family.samples) >= 1:
                return
        time.sleep(0.2)
    raise AssertionError("the follow opened no stream")


def _loss_steps(frames: list) -> list[int]:
    return [d["step"] for _, ev, d in frames if ev == "metric" and d["name"] == "loss"]


def test_streams_survive_a_redis_restart_mid_job(ops_stack: StackHandle, gate: Path) -> None:
    h = ops_stack
    # held at its 20th batch until the restart is done (tests/user_data.py), so the restart lands
    # mid-job whatever the machine's speed (100 steps of FAST had ended before it in one run), and
    # every step after the 19th reaches the stream after the restart
    spec = {**long_job("redis-restart", 300), **held_data(upload_held(h), gate, hold_at=20)}
    job = h.submit(spec)
    frames: list = []
    reader = threading.Thread(
        target=lambda: frames.extend(read_sse(h.base_url, f"/api/jobs/{job['id']}/stream", token=h.token))
    )
    reader.start()
    follow = _follow(h, job["id"])
    h.wait_until(job["id"], lambda j: j["progress"]["step"] >= 10, timeout=120)
    h.stack.restart_redis()
    # the restart happened mid-job, or this test would prove nothing
    assert h.job(job["id"])["status"] == "running"
    gate.unlink()
    done = h.wait(job["id"], timeout=300)
    reader.join(timeout=60)
    assert not reader.is_alive(), "the stream did not close after the job ended"
    # one connection, opened before the restart: every step exactly once, in order
    assert _loss_steps(frames) == list(range(1, spec["train"]["steps"] + 1))
    assert [d["status"] for _, ev, d in frames if ev == "status"][-1] == "succeeded"
    ids = [fid for fid, ev, _ in frames if ev == "metric"]
    assert len(ids) == len(set(ids))
    out, err = follow.communicate(timeout=120)
    assert follow.returncode == 0, err
    assert "Traceback" not in err
    assert done["result"]["steps"] == spec["train"]["steps"]


def test_follow_reconnects_when_the_api_restarts(ops_stack: StackHandle, gate: Path) -> None:
    h = ops_stack
    # held at its 20th batch until the restart is done (tests/user_data.py): it outlasts the
    # restart whatever the machine's speed
    job = h.submit({**long_job("api-restart", 300), **held_data(upload_held(h), gate, hold_at=20)})
    follow = _follow(h, job["id"])
    _connected(h)
    h.wait_until(job["id"], lambda j: j["progress"]["step"] >= 10, timeout=120)
    h.stack.restart_api()
    # the restart happened mid-job, or this test would prove nothing
    assert h.job(job["id"])["status"] == "running"
    gate.unlink()
    h.wait(job["id"], timeout=300)
    out, err = follow.communicate(timeout=120)
    assert follow.returncode == 0, err
    assert "reconnecting" in err and "Traceback" not in err
    assert '"final_loss"' in out  # it saw the job to its end and printed the result


def test_checkpoints_are_pruned_and_a_finished_job_is_deleted(ops_stack: StackHandle) -> None:
    h = ops_stack
    job = h.submit({**FAST, "train": {**FAST["train"], "steps": 12}, "checkpoint_every": 2})
    h.wait(job["id"], timeout=300)
    folder = h.stack.root / "jobs" / str(job["id"])
    # SHARDYARD_CHECKPOINT_KEEP is unset: the newest 3 of the 6 saved stay. The trainer's last
    # save kept more when the relay was behind then; the worker prunes once the job has ended
    # (workers/execute.py prune_at_end), just after its status is written
    deadline = time.monotonic() + 30
    while (kept := sorted(int(p.name[5:-3]) for p in (folder / "checkpoints").glob("step-*.pt"))) != [
        8,
        10,
        12,
    ]:
        assert time.monotonic() < deadline, kept
        time.sleep(0.1)
    # the job's applied step once its result was stored: its last step
    assert (folder / "checkpoints" / "applied-step").read_text() == "12\n"
    r = h.client.delete(f"/api/jobs/{job['id']}")
    assert r.status_code == 204, r.text
    assert not folder.exists()
    assert h.client.get(f"/api/jobs/{job['id']}/metrics").status_code == 404


def test_a_selection_s_trials_are_pruned_when_they_end(ops_stack: StackHandle) -> None:
    h = ops_stack
    base = {**FAST, "name": "pruned", "train": {**FAST["train"], "steps": 12}, "checkpoint_every": 2}
    body = grid_batch("pruned", base, {"train.lr": [1e-3, 3e-3]}, devices=2, checkpoints="all")
    done = h.wait_selection(h.submit_selection(body)["id"], timeout=300)
    assert done["status"] == "succeeded" and len(done["trials"]) == 2
    root = h.stack.root / "selections" / str(done["id"])
    # as a job's folder: the newest 3 of the 6 saved stay (SHARDYARD_CHECKPOINT_KEEP unset). The
    # executor's last saves read an applied step that lagged; the worker prunes each trial of the
    # group once it has ended (workers/selection.py), before the batch shows as ended
    for i in range(2):
        kept = sorted(int(p.name[5:-3]) for p in (root / f"trial-{i}").glob("step-*.pt"))
        assert kept == [8, 10, 12], (i, kept)


def test_a_full_disk_under_the_checkpoints_fails_the_job_with_the_reason(
    ops_stack: StackHandle, tmp_path: Path
) -> None:
    """Injects a real full disk: the job's checkpoint folder is a 1 MiB tmpfs and a checkpoint of
    this model (weights and AdamW state) is several MiB, so the write runs into ENOSPC inside
    torch's zip writer, which reports it as its own "unexpected pos" RuntimeError; the job's error
    must still say No space left on device, with the path and the free bytes, and the job is not
    retried (a full disk is not cured by a new attempt on the same storage). Needs permission to
    mount (root here); without it the trainer-level tests in tests/trainer/test_checkpoint.py
    cover the same path with a file-size limit."""
    h = ops_stack
    big = long_job("full-disk", 6, checkpoint_every=2)
    spec = JobSpec.model_validate(big)
    with session_for(h.stack.database_url) as s:
        # owned by a user with a quota of 0 running jobs: the scheduler holds it until the folder
        # below is in place
        held = create_user(s, name="full-disk", max_running_jobs=0)
        job_id = create_job(s, name="full-disk", spec=spec.model_dump(), steps=6, owner_id=held.id).id
    # mounted on the job's own checkpoint folder (a link out of the job's folder would lead
    # nowhere inside the trainer's sandbox, which binds that folder alone)
    workdir = h.stack.root / "jobs" / str(job_id)
    mount = workdir / "checkpoints"
    try:
        cm = full_disk(mount, size_kib=1024)
        cm.__enter__()
    except RuntimeError as e:
        pytest.skip(f"no full disk to inject here: {e}")
    try:
        with session_for(h.stack.database_url) as s:  # now the scheduler places and sends it
            s.execute(update(User).where(User.id == held.id).values(max_running_jobs=1))
            s.commit()
        done = h.wait(job_id, statuses=("failed",), timeout=300)
        left = sorted(p.name for p in mount.iterdir())
    finally:
        cm.__exit__(None, None, None)
    error = done["error"]
    path = h.stack.root / "jobs" / str(job_id) / "checkpoints" / "step-00000002.pt"
    assert f"No space left on device: checkpoint {path} could not be written" in error, error
    assert " bytes are free there" in error and "unexpected pos" not in error, error
    assert done["attempts"] == 1 and done["restarts"] == 0
    # no partial checkpoint, no temporary file: only the worker's note of the applied step (a few
    # bytes, written at the attempt's start, before the disk filled)
    assert left == [APPLIED_FILE], left
