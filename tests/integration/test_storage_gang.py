"""A gang without a shared disk: a 2-rank pipeline job over two Celery workers (one rank each,
gloo over loopback under torchrun's c10d rendezvous), each worker on its OWN data dir, with the
checkpoints in a real S3-API server process that the test starts (moto's standalone server;
production uses AWS S3, MinIO or Ceph through the same s3fs code).

Each node uploads its own rank's piece (pp0-tp0 or pp1-tp0) as it is written. Node 0's whole
worker is killed with SIGKILL mid-run; the gang goes back to the queue and is placed again on the
surviving worker and a NEW worker whose data dir never held the job: every node restores every
piece from the store, and the job resumes from the store's checkpoint (not step 0) with every loss
step exactly once.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from api.stack import Stack
from core.storage import open_storage
from db import ingest as dbi
from db import jobs as dbj
from db.connection import session_for
from db.models import Job, Reservation
from tests.conftest import StackHandle
from tests.integration.test_gang import SPEC as GANG_SPEC
from tests.integration.test_gang import _attempt_processes
from tests.proc_tree import process_tree
from tests.s3 import S3Server

pytestmark = [pytest.mark.integration, pytest.mark.slow]

URL = "s3://shardyard/gang"
# long enough that the kill lands mid-job on an idle machine (at 60 steps the job had ended by
# the time both pieces of a checkpoint were in the store)
STEPS = 200
SPEC: dict[str, Any] = {
    **GANG_SPEC,  # test_gang.py's model, data and checkpoints
    "name": "gang-s3",
    "train": {**GANG_SPEC["train"], "steps": STEPS},
    # two pipeline stages: each rank writes its own piece of every checkpoint
    "parallel": {"pipeline": GANG_SPEC["parallel"]["pipeline"]},
}
ADDRS = {1: "127.0.0.2", 2: "127.0.0.1", 3: "127.0.0.3"}


@pytest.fixture(scope="module")
def gang(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[StackHandle, S3Server, dict[int, Path]]]:
    root = tmp_path_factory.mktemp("gang-s3")
    s3 = S3Server(log=root / "moto.log").start()
    s3.create_bucket("shardyard")
    dirs = {i: root / f"host{i}" for i in ADDRS}
    st = Stack(
        root=root / "api",
        workers=0,
        extra_env={
            **s3.env,
            "SHARDYARD_STORAGE_URL": URL,
            "SHARDYARD_STORAGE_SYNC_S": "0.5",
            "SHARDYARD_WORKER_SLOTS": "1",
            "SHARDYARD_HEARTBEAT_S": "1",
            "SHARDYARD_LEASE_S": "8",
            "SHARDYARD_RECONCILE_S": "2",
            "SHARDYARD_GANG_JOIN_S": "120",
            "SHARDYARD_WORKER_ALIVE_S": "5",
            # the default SHARDYARD_CHECKPOINT_KEEP (3): the frozen node's copies in the store lag
            # its folder, and the store keeps a step both pieces hold (workers/ckpt_sync.py
            # store_floor; it restarted from step 0 when each node mirrored its own pruning)
        },
        worker_env={
            i: {"SHARDYARD_DATA_DIR": str(d), "SHARDYARD_NODE_ADDR": ADDRS[i], "LOGLEVEL": "INFO"}
            for i, d in dirs.items()
        },
    )
    try:
        st.start()
        st.start_worker(1)
        st.start_worker(2)
        h = StackHandle(st)
        yield h, s3, dirs
        h.client.close()
    finally:
        st.stop()
        s3.stop()


def _job(url: str, job_id: int) -> Job:
    with session_for(url) as s:
        return dbj.get_job(s, job_id)


def test_a_gang_that_lost_a_node_resumes_from_the_store_on_a_new_host(gang) -> None:  # noqa: ANN001
    h, s3, dirs = gang
    st, url = h.stack, h.stack.database_url
    store = open_storage(url=URL, data_dir=st.root, endpoint_url=s3.endpoint)
    job_id = h.submit(SPEC)["id"]
    prefix = f"jobs/{job_id}/checkpoints"

    def pieces() -> dict[str, set[int]]:
        found: dict[str, set[int]] = {}
        for key in store.list(prefix):
            piece, name = key.removeprefix(prefix + "/").split("/")
            found.setdefault(piece, set()).add(int(name[5:13]))
        return found

    # both nodes uploaded their piece of a checkpoint whose lines are applied
    deadline = time.monotonic() + 300
    while True:
        job, got = _job(url, job_id), pieces()
        whole = set.intersection(*got.values()) if len(got) == 2 else set()
        if job.applied_step >= 5 and any(0 < s <= job.applied_step for s in whole):
            break
        assert job.status not in ("failed", "cancelled", "succeeded"), (job.status, job.error)
        assert time.monotonic() < deadline, f"no whole checkpoint in the store: {got}"
        time.sleep(0.3)
    assert sorted(got) == ["pp0-tp0", "pp1-tp0"], "each node uploaded its own rank's piece"
    with session_for(url) as s:
        nodes = {r.node_rank: r.worker for r in s.query(Reservation).filter_by(job_id=job_id).all()}
    assert len(nodes) == 2
    index = next(i for i in (1, 2) if nodes[0].startswith(f"worker{i}@"))
    # node 0's whole worker (Celery, torchrun, its rank): frozen first so the kill lands mid-job,
    # then killed -9
    victim = process_tree([st.procs.pop(f"worker{index}").pid])
    for pid in victim:
        os.kill(pid, signal.SIGSTOP)
    try:
        at = _job(url, job_id)
        assert at.status == "running" and at.step < STEPS, "the kill must land mid-job"
    finally:  # never leave a stopped process behind, whatever the check says
        for pid in victim:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 120
    while _job(url, job_id).attempts < 2 and _job(url, job_id).status == "running":
        assert time.monotonic() < deadline, "the gang was not given back"
        time.sleep(0.3)
    while (left := _attempt_processes(job_id, 1)) and time.monotonic() < deadline:
        time.sleep(0.3)
    assert left == [], f"attempt 1 still runs: {left}"

    # a new host takes the lost node's place: its data dir has never held this job
    assert not (dirs[3] / "jobs").exists()
    st.start_worker(3)
    done = h.wait(job_id, timeout=400)
    assert done["attempts"] == 2
    with session_for(url) as s:
        starts = [
            e.data["start_step"]
            for e in dbi.events_after(s, job_id=job_id, kinds=["event"])
            if e.message == "start"
        ]
        logs = [e.message for e in dbi.events_after(s, job_id=job_id, kinds=["log"])]
        series = dbi.metric_series(s, job_id=job_id, names=["loss"])
    assert starts[0] == 0 and starts[-1] >= 5, f"the restarted gang resumed from the store: {starts}"
    assert series["loss"][0] == list(range(1, STEPS + 1)), "every loss step exactly once"
    assert any(m.startswith(f"restored checkpoint step {starts[-1]} from {URL}") for m in logs), logs
    # the new host fetched both pieces (which rank it would get was known only at the rendezvous)
    restored = sorted(
        p.parent.name for p in (dirs[3] / "jobs" / str(job_id) / "checkpoints").rglob("step-*.pt")
    )
    assert set(restored) == {"pp0-tp0", "pp1-tp0"}, restored
    # once the job has ended, each node prunes the store (workers/execute.py prune_at_end): the
    # newest 3 steps of both pieces stay, whatever the trainers' last saves had kept
    deadline = time.monotonic() + 60
    while (got := pieces()) != {p: {STEPS - 10, STEPS - 5, STEPS} for p in ("pp0-tp0", "pp1-tp0")}:
        assert time.monotonic() < deadline, got
        time.sleep(0.3)
