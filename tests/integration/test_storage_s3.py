"""Storage that does not assume one disk, on the real stack: a redis-server, the API and Celery
workers, each with its OWN data dir (hosts without a shared disk), and SHARDYARD_STORAGE_URL in a
real S3-API server process that the test starts (moto's standalone server, tests/s3.py).
Production points the same setting at AWS S3, MinIO or Ceph; the code path (s3fs, botocore) is
the same.

- a workspace uploaded to the API runs on a worker whose data dir never saw the upload;
- a worker killed with SIGKILL mid-run: the job resumes on a second worker (another data dir) from
  the store's checkpoint, not step 0, with every loss step exactly once; DELETE removes its objects;
- the store stopped mid-run: the failed uploads are in the job's log and retried, the worker goes
  on; a job that starts while it is down fails naming the store, never from step 0;
- a TPE batch's trials asked while its group runs upload their checkpoints too.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from api.stack import Stack
from core.storage import open_storage
from db import ingest as dbi
from db.connection import session_for
from tests.archives import targz
from tests.conftest import TINY_SPEC, StackHandle
from tests.integration.test_faults import FAST as FAULT_ENV
from tests.integration.test_faults import SPEC as FAULT_SPEC
from tests.integration.test_faults import STEPS
from tests.integration.test_workspaces import DATA_PY, falls, tiny, upload
from tests.s3 import S3Server
from tests.user_data import held_data, upload_held
from workers.spare import unpacked_workspace

pytestmark = pytest.mark.integration

URL = "s3://shardyard/it"
# test_faults.py's windows and job, stored (a test whose fault must land mid-run holds the job)
FAST = {**FAULT_ENV, "SHARDYARD_STORAGE_SYNC_S": "0.5"}
SPEC = {**FAULT_SPEC, "name": "stored"}


class Hosts:
    def __init__(self, root: Path, s3: S3Server) -> None:
        self.s3 = s3
        self.dirs = {i: root / f"host{i}" for i in (1, 2)}
        self.stack = Stack(
            root=root / "api",
            workers=0,
            concurrency=1,
            extra_env={**FAST, **s3.env, "SHARDYARD_STORAGE_URL": URL},
            worker_env={i: {"SHARDYARD_DATA_DIR": str(d)} for i, d in self.dirs.items()},
        )
        self.h: StackHandle | None = None

    @property
    def store(self):  # noqa: ANN201
        return open_storage(url=URL, data_dir=self.stack.root, endpoint_url=self.s3.endpoint)

    def only(self, index: int) -> None:
        """Worker `index` alone is running (the other one, if up, is stopped warm)."""
        for i in (1, 2):
            proc = self.stack.procs.get(f"worker{i}")
            if i != index and proc is not None:
                self.stack.stop_process(f"worker{i}", timeout_s=60)
        proc = self.stack.procs.get(f"worker{index}")
        if proc is None or proc.poll() is not None:
            self.stack.start_worker(index)


@pytest.fixture(scope="module")
def hosts(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Hosts]:
    root = tmp_path_factory.mktemp("hosts")
    s3 = S3Server(log=root / "moto.log").start()
    s3.create_bucket("shardyard")
    h = Hosts(root, s3)
    try:
        h.stack.start()
        h.h = StackHandle(h.stack)
        yield h
    finally:
        if h.h is not None:
            h.h.client.close()
        h.stack.stop()
        s3.stop()


def _logs(h: StackHandle, job_id: int) -> list[str]:
    return [
        e["message"] for e in h.client.get(f"/api/jobs/{job_id}/logs", params={"limit": 1000}).json()["items"]
    ]


def _starts(h: StackHandle, job_id: int) -> list[int]:
    """start_step of each attempt's trainer start."""
    with session_for(h.stack.database_url) as s:
        events = dbi.events_after(s, job_id=job_id, kinds=["event"])
        return [e.data["start_step"] for e in events if e.message == "start"]


def test_a_workspace_job_runs_on_a_worker_that_never_saw_the_upload(hosts: Hosts) -> None:
    h = hosts.h
    hosts.only(1)
    resp = upload(h, targz({"mydata/__init__.py": b"", "mydata/source.py": DATA_PY}))
    assert resp.status_code == 201, resp.text
    ws = resp.json()
    key = f"workspaces/{ws['digest']}.tar.gz"
    assert hosts.store.exists(key), "the archive is in the store"
    assert not (hosts.stack.root / key).exists() and not (hosts.dirs[1] / key).exists(), "in no data dir"
    data = {"kind": "python", "entry": "mydata.source:batches", "args": {"period": 13}, "vocab_size": 13}
    job = h.submit(tiny(name="pydata-s3", data=data, workspace=ws["ref"]))
    h.wait(job["id"], timeout=240)
    assert falls(h, job["id"])
    assert (hosts.dirs[1] / key).is_file(), "the worker fetched it into its own data dir"
    # its weights download from the store through the API, whose data dir never held them
    resp = h.client.get(f"/api/jobs/{job['id']}/checkpoint")
    assert resp.status_code == 200, resp.text
    newest = f"jobs/{job['id']}/checkpoints/step-00000030.pt"
    assert not (hosts.stack.root / newest).exists() and resp.content == hosts.store.get_bytes(newest)
    assert (unpacked_workspace(hosts.dirs[1] / "jobs" / str(job["id"])) / "mydata" / "source.py").is_file()

    assert h.client.delete(f"/api/workspaces/{ws['id']}").status_code == 204
    assert not hosts.store.exists(key), "DELETE removed the archive from the store"


def _kill(st: Stack, name: str) -> None:
    proc = st.procs.pop(name)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def test_sigkill_mid_run_resumes_on_another_host_from_the_store(hosts: Hosts, gate: Path) -> None:
    h = hosts.h
    hosts.only(1)
    # held at its 20th batch until the gate goes (tests/user_data.py): the kill lands mid-run
    # whatever the machine's speed (this 100-step job takes about a second on an idle machine)
    job_id = h.submit({**SPEC, **held_data(upload_held(h), gate, hold_at=20)})["id"]
    prefix = f"jobs/{job_id}/checkpoints"
    # mid-run, with a checkpoint in the store and its lines applied (applied_step >= 8)
    h.wait_until(job_id, lambda j: j["progress"]["step"] >= 12, timeout=180)
    deadline_step = h.wait_until(job_id, lambda _j: len(hosts.store.list(prefix)) > 0, timeout=60)
    assert deadline_step["status"] == "running" and deadline_step["progress"]["step"] < STEPS
    _kill(hosts.stack, "worker1")
    gate.unlink()
    # another host: its data dir has never held this job. Looked at before worker2 starts: once it
    # beats, its reconciler takes the lapsed lease back and the scheduler places the job there,
    # which can claim it and make its folder before start_worker sees the worker registered
    assert not (hosts.dirs[2] / "jobs" / str(job_id)).exists()
    hosts.only(2)

    done = h.wait(job_id, timeout=300)
    assert done["attempts"] == 2 and done["result"] is not None
    got = h.client.get(f"/api/jobs/{job_id}/metrics", params={"names": "loss,val_loss"}).json()["series"]
    assert got["loss"]["steps"] == list(range(1, STEPS + 1)), "every loss step exactly once"
    assert got["val_loss"]["steps"] == list(range(10, STEPS + 1, 10))
    starts = _starts(h, job_id)
    assert starts[0] == 0 and starts[-1] >= 4, f"the second attempt resumed from the store: {starts}"
    logs = _logs(h, job_id)
    assert any(m.startswith(f"restored checkpoint step {starts[-1]} from {URL}") for m in logs), logs
    assert any(m.startswith("resumed from step-") for m in logs)
    # the attempt's end reached the store: the final checkpoint (with the result) is there
    assert f"{prefix}/step-{STEPS:08d}.pt" in hosts.store.list(prefix)

    assert h.client.delete(f"/api/jobs/{job_id}").status_code == 204
    assert hosts.store.list(f"jobs/{job_id}") == [], "DELETE removed the job's objects from the store"


def test_the_store_going_down(hosts: Hosts, gate: Path) -> None:
    """Mid-run: the failed uploads are reported in the job's log and retried; the trainer goes on
    and the job ends. At an attempt's start: the job fails naming the store (it is not started
    from step 0). An operator's requeue, once the store is back, runs it."""
    h = hosts.h
    hosts.only(1)
    # held at its 20th batch (tests/user_data.py) until the store is down, then 0.05 s a batch: the
    # next checkpoint's upload fails seconds before the end whatever the machine's speed (300
    # steps of this model took about 3 s on an idle machine)
    held = {**SPEC, **held_data(upload_held(h), gate, hold_at=20, pause=0.05)}
    job_id = h.submit({**held, "name": "store-down", "train": {**SPEC["train"], "steps": 300}})["id"]
    # the held trainer's last checkpoint (step 16) is in the store: what fails next is a new one
    last = f"jobs/{job_id}/checkpoints/step-{16:08d}.pt"
    h.wait_until(job_id, lambda _j: last in hosts.store.list(f"jobs/{job_id}/checkpoints"), timeout=180)
    hosts.s3.stop()
    gate.unlink()
    reported = h.wait_until(
        job_id,
        lambda j: (
            j["status"] != "running"
            or any(
                "checkpoint upload failed, retrying: storage s3://shardyard/it/" in m
                for m in _logs(h, job_id)
            )
        ),
        timeout=120,
    )
    assert reported["status"] == "running", "the upload failure was reported while the trainer ran"
    done = h.wait(job_id, timeout=300)
    assert done["status"] == "succeeded", "a failed upload never stops the trainer"

    second = h.submit({**SPEC, "name": "no-store"})["id"]
    failed = h.wait(second, ("failed",), timeout=120)
    assert failed["error"].startswith("the checkpoint and workspace store could not be read"), failed["error"]
    assert f"storage {URL}/jobs/{second}/checkpoints/" in failed["error"], failed["error"]
    assert _starts(h, second) == [], "the trainer never started"

    hosts.s3.start()  # moto keeps nothing: an empty store with its bucket made again
    hosts.s3.create_bucket("shardyard")
    resp = h.client.post(f"/api/jobs/{second}/requeue", json={"reason": "the store is back"})
    assert resp.status_code == 200, resp.text
    h.wait(second, timeout=300)


def test_a_sampler_trial_asked_mid_group_uploads_its_checkpoints(hosts: Hosts) -> None:
    """A TPE batch's trials 2 and 3 join the running group (workers/search.py ask_due): their
    checkpoints reach the store like the group's first trials'."""
    h = hosts.h
    hosts.only(1)
    body = {
        "name": "tpe-store",
        "base": {
            **TINY_SPEC,
            "name": "tpe-store",
            "train": {**TINY_SPEC["train"], "steps": 6, "eval_every": 3},
            "checkpoint_every": 1,
        },
        "space": {"train.lr": {"low": 1e-4, "high": 3e-2, "log": True}},
        "method": "tpe",
        "trials": 4,
        "parallel": 2,
        "startup_trials": 2,
        "devices": 2,
        "checkpoints": "all",
    }
    done = h.wait_selection(h.submit_selection(body)["id"], timeout=300)
    assert done["status"] == "succeeded" and len(done["trials"]) == 4
    keys = hosts.store.list(f"selections/{done['id']}")
    for i in range(4):
        # each trial saved 6; its ended trial keeps the newest 3 in the store as in its folder
        # (workers/selection.py _prune_ended), before the batch showed as ended
        steps = sorted(int(k.rpartition("/step-")[2][:-3]) for k in keys if f"/trial-{i}/step-" in k)
        if steps != [4, 5, 6]:  # what the trial's job says, to tell a late prune from a skipped one
            job = h.job(next(t["job_id"] for t in done["trials"] if t["index"] == i))
            logs = h.client.get(f"/api/jobs/{job['id']}/logs").text[-4000:]
            raise AssertionError(f"trial {i} kept {steps}; its job {job}; its log {logs}")


def test_weights_and_the_best_checkpoint_download_from_the_store(hosts: Hosts, tmp_path: Path) -> None:
    """The API's data dir is not the worker's: the checkpoint, its weights as safetensors and the
    best one are read from moto's S3, and the weights load into the recipe's model."""
    from safetensors.torch import load as load_safetensors

    from tests.integration.test_weights_download import SPEC as WEIGHTS_SPEC
    from tests.integration.test_weights_download import check_weights

    assert hosts.h is not None
    h = hosts.h
    hosts.only(1)
    job_id = h.submit({**WEIGHTS_SPEC, "name": "s3-weights"})["id"]
    h.wait(job_id, timeout=240)
    pt = h.client.get(f"/api/jobs/{job_id}/checkpoint", params={"best": "true"})
    assert pt.status_code == 200, pt.text
    step = int(pt.headers["x-checkpoint-step"])
    with hosts.store.open_read(f"jobs/{job_id}/checkpoints/step-{step:08d}.pt") as fh:
        assert fh.read() == pt.content  # the store's bytes
    resp = h.client.get(f"/api/jobs/{job_id}/checkpoint", params={"best": "true", "format": "safetensors"})
    assert resp.status_code == 200 and resp.headers["x-checkpoint-step"] == str(step), resp.text
    check_weights(WEIGHTS_SPEC, load_safetensors(resp.content), pt.content, tmp_path / "s3.pt")
