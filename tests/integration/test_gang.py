"""Jobs wider than one worker, with real processes on this machine: a redis-server, the API, two
Celery workers with 2 slots each (distinct -n names, one SQLite file, one data_dir standing in for
the shared storage multi-node jobs need) and a 4-rank gloo job spread over both under torchrun's
c10d rendezvous over loopback.

The two workers advertise different loopback addresses (127.0.0.1 and 127.0.0.2, SHARDYARD_NODE_ADDR)
and node 0 is put on the one at 127.0.0.2: c10d numbers the agents by their sorted addresses, so
global rank 0, the rank that prints the job's lines, runs on node 1, and every line reaches the
database through a node that does not own the job's lease.

What gloo over loopback proves for NCCL multi-node: the gang's control plane is the same whatever
the backend: the placement and the per-node tasks, node 0's rendezvous endpoint and the others'
wait for it, c10d's rank numbering across agents (so whichever node holds rank 0 relays the lines,
fenced), the shared checkpoint folder, and the gang given back whole and resumed from its last
checkpoint when a node dies. What it does not prove: NCCL's own transport (InfiniBand/RoCE, NIC
choice via NCCL_SOCKET_IFNAME, GPU-direct), that a cross-host address is reachable and its ports open,
that one GPU per local rank is picked on a real multi-GPU host (trainer/distributed.py sets
LOCAL_RANK's device), or how long a NCCL collective hangs when a peer host vanishes without closing
its sockets (a kill -9 on one machine closes them at once; across hosts the node's lease running out
is what ends the gang, which tests/unit/test_gang_leases.py checks).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from api.schemas import JobSpec
from api.stack import Stack, worker_command
from core.broker import node_queue, send_run_job
from core.messages import parse_line
from core.settings import Settings
from db import jobs as dbj
from db.engine import session_for
from db.models import Job, Reservation
from workers.execute import trainer_command

pytestmark = [pytest.mark.integration, pytest.mark.slow]

STEPS = 60
SPEC: dict[str, Any] = {
    "name": "gang",
    "model": {"kind": "gpt", "layers": 2, "d_model": 32, "heads": 2, "seq_len": 32},
    "data": {"max_chars": 200_000},
    "train": {"steps": STEPS, "batch_size": 8, "lr": 3e-3, "eval_every": 20, "seed": 0},
    # pipeline x data parallel: stage activations and gradient all-reduces both cross the nodes
    "parallel": {"pipeline": {"stages": 2, "microbatches": 2, "schedule": "1f1b"}, "data_parallel": 2},
    "checkpoint_every": 5,
}
ADDRS = {1: "127.0.0.1", 2: "127.0.0.2"}
"""Each worker's address; node 0 goes on worker 2, so c10d's rank 0 is on worker 1 (node 1)."""


class Gang:
    """The stack with two workers of 2 slots each, and the one-worker 4-rank reference run."""

    def __init__(self, root: Path) -> None:
        self.stack = Stack(
            root=root,
            workers=0,
            extra_env={
                "SHARDYARD_WORKER_SLOTS": "2",
                "SHARDYARD_HEARTBEAT_S": "1",
                "SHARDYARD_LEASE_S": "8",
                "SHARDYARD_RECONCILE_S": "2",
                "SHARDYARD_GANG_JOIN_S": "120",
                "SHARDYARD_CHECKPOINT_KEEP": "0",
            },
        )
        self.url = self.stack.database_url
        self.settings = Settings(database_url=self.url, broker_url=self.stack.broker_url, data_dir=root)
        self.names: dict[int, str] = {}
        self.ref: subprocess.Popen[str] | None = None
        self._want: dict[str, tuple[list[int], list[float]]] | None = None

    def reference(self) -> dict[str, tuple[list[int], list[float]]]:
        """The one-worker 4-rank run's loss and val_loss (started with the stack)."""
        if self._want is None:
            assert self.ref is not None
            self._want = reference_series(self.ref)
        return self._want

    def start_worker(self, index: int) -> None:
        """Worker `index` (its own -n name and address); LOGLEVEL=INFO makes torchrun's agent log
        the rendezvous rank it got into the node's stderr.log."""
        cmd = worker_command(queues="cpu,gpu", concurrency=1, name=f"worker{index}@%h")
        env = {**self.stack.env, "SHARDYARD_NODE_ADDR": ADDRS[index], "LOGLEVEL": "INFO"}
        proc = self.stack._spawn(f"worker{index}", [*cmd, "--without-gossip", "--without-mingle"], env)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            assert proc.poll() is None, (self.stack.root / f"worker{index}.log").read_text()[-3000:]
            with session_for(self.url) as s:
                seen = [
                    w.name for w in dbj.live_workers(s, within_s=3) if w.name.startswith(f"worker{index}@")
                ]
            if seen:
                self.names[index] = seen[0]
                return
            time.sleep(0.3)
        raise AssertionError(f"worker{index} did not register")

    def place(self, job_id: int) -> None:
        """The scheduler's gang placement: both nodes reserved in one transaction, then one task
        per node to that worker's own queue (node 0 on worker 2)."""
        with session_for(self.url) as s:
            job = s.get(Job, job_id)
            job.nnodes = 2
            for rank, index in ((0, 2), (1, 1)):
                s.add(
                    Reservation(
                        job_id=job_id,
                        worker=self.names[index],
                        node_rank=rank,
                        nnodes=2,
                        slots=2,
                        attempt=job.attempts,
                    )
                )
            s.commit()
        for rank, index in ((0, 2), (1, 1)):
            send_run_job(
                self.settings, job_id=job_id, queue=node_queue(self.names[index]), node_rank=rank, nnodes=2
            )

    def submit(self) -> int:
        with session_for(self.url) as s:
            spec = JobSpec.model_validate(SPEC).model_dump()  # as the API stores it
            return dbj.create_job(s, name="gang", spec=spec, world_size=4, steps=STEPS).id

    def job(self, job_id: int) -> Job:
        with session_for(self.url) as s:
            return dbj.get_job(s, job_id)

    def wait(self, job_id: int, pred, what: str, timeout: float = 300) -> Job:  # noqa: ANN001
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            job = self.job(job_id)
            if pred(job):
                return job
            assert job.status not in ("failed", "cancelled"), f"job {job_id} {job.status}: {job.error}"
            time.sleep(0.2)
        raise AssertionError(f"job {job_id}: not {what} after {timeout}s: {self.job(job_id).status}")

    def series(self, job_id: int) -> dict[str, tuple[list[int], list[float]]]:
        with session_for(self.url) as s:
            return dbj.metric_series(s, job_id=job_id, names=["loss", "val_loss"])


def reference_run(root: Path) -> subprocess.Popen[str]:
    """The same spec as a one-worker 4-rank job: the command workers/execute.py runs for it."""
    root.mkdir(parents=True, exist_ok=True)
    spec_path = root / "spec.json"
    spec_path.write_text(json.dumps(SPEC))
    cmd = trainer_command(world_size=4, spec_path=spec_path, ckpt_dir=root / "ckpt", stop_file=root / "stop")
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)


def reference_series(proc: subprocess.Popen[str]) -> dict[str, tuple[list[int], list[float]]]:
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0
    series: dict[str, tuple[list[int], list[float]]] = {}
    for line in out.splitlines():
        msg = parse_line(line)
        if msg is not None and msg.kind == "metric" and msg.name in ("loss", "val_loss"):
            steps, values = series.setdefault(msg.name, ([], []))
            steps.append(msg.step)
            values.append(msg.value)
    return series


@pytest.fixture(scope="module")
def gang(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gang]:
    root = tmp_path_factory.mktemp("gang")
    g = Gang(root / "stack")
    g.ref = reference_run(root / "reference")  # runs while the stack starts
    try:
        g.stack.start()
        g.start_worker(1)
        g.start_worker(2)
        yield g
    finally:
        if g.ref.poll() is None:
            g.ref.kill()
        g.stack.stop()


def assert_same_losses(got: dict, want: dict) -> None:
    for name in ("loss", "val_loss"):
        assert got[name][0] == want[name][0], f"{name}: each step exactly once"
        torch.testing.assert_close(torch.tensor(got[name][1]), torch.tensor(want[name][1]))


def test_a_4_rank_job_spans_two_workers_and_matches_the_one_worker_run(gang: Gang) -> None:
    g = gang
    job_id = g.submit()
    g.place(job_id)
    job = g.wait(job_id, lambda j: j.status == "succeeded", "succeeded")
    assert job.attempts == 1 and job.result["steps"] == STEPS
    want = g.reference()
    assert want["loss"][0] == list(range(1, STEPS + 1))
    assert_same_losses(g.series(job_id), want)
    # the rank that printed every line ran on node 1 (worker 1), not on the job owner's node
    node_logs = g.stack.root / "jobs" / str(job_id)
    ranks = {
        n: re.findall(r"global_ranks=\[([\d, ]+)\]", (node_logs / f"node-{n}" / "stderr.log").read_text())
        for n in (0, 1)
    }
    assert ranks == {0: ["2, 3"], 1: ["0, 1"]}, ranks
    with session_for(g.url) as s:  # the job's end gave its slots back
        assert s.query(Reservation).filter_by(job_id=job_id).count() == 0


def _tree(root_pid: int) -> list[int]:
    """root_pid and every process under it (/proc, no extra package)."""
    parents: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            parents.setdefault(ppid, []).append(int(d.name))
    out, todo = [], [root_pid]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo += parents.get(pid, [])
    return out


def test_killing_a_node_restarts_the_gang_from_its_checkpoint(gang: Gang) -> None:
    g = gang
    job_id = g.submit()
    g.place(job_id)
    g.wait(job_id, lambda j: j.status == "running" and j.applied_step >= 5, "past its first checkpoint")
    # worker 2 runs node 0: the job's owner and the rendezvous host. Freeze its whole tree first
    # (Celery, its pool, torchrun, the ranks): the gang then waits in its collectives, so the
    # kill lands mid-job whatever the machine's speed; then kill -9 all of it
    victim = _tree(g.stack.procs.pop("worker2").pid)
    for pid in victim:
        os.kill(pid, signal.SIGSTOP)
    at = g.job(job_id)
    assert at.status == "running" and at.step < STEPS, "the kill must land mid-job"
    for pid in victim:
        os.kill(pid, signal.SIGKILL)

    # the surviving node (worker 1) is fenced off and the job goes back whole, counted
    back = g.wait(job_id, lambda j: j.status == "queued", "given back", timeout=120)
    assert back.attempts == 1
    with session_for(g.url) as s:
        assert s.query(Reservation).filter_by(job_id=job_id).count() == 0
        event = dbj.last_status_event(s, job_id=job_id)
        assert event.data.get("gang_restart") == 1, event.data
    survivor = g.stack.root / "jobs" / str(job_id) / "node-1"
    assert survivor.is_dir()

    # the worker comes back; the gang is placed again and resumes from the checkpoint
    g.start_worker(2)
    g.place(job_id)
    job = g.wait(job_id, lambda j: j.status == "succeeded", "succeeded")
    assert job.attempts == 2
    with session_for(g.url) as s:
        logs = [e.message for e in dbj.events_after(s, job_id=job_id, kinds=["log"])]
        starts = [
            e.data["start_step"]
            for e in dbj.events_after(s, job_id=job_id, kinds=["event"])
            if e.message == "start"
        ]
    assert starts[0] == 0 and starts[-1] >= 5, starts
    assert any(m.startswith("resumed from step-") for m in logs)
    got = g.series(job_id)
    assert got["loss"][0] == list(range(1, STEPS + 1)), "every step exactly once"
    # resumed exactly: the same losses as the uninterrupted one-worker run
    assert_same_losses(got, g.reference())
