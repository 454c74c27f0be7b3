"""A Slurm pool on a real two-node Slurm cluster (make test-slurm, tests/slurm/cluster.sh): the stack
(redis-server, the API with its scheduler) has no Celery worker; the pool's submitter
(`python -m workers.slurm_pool`) submits each placed job with sbatch, and the node agents srun
starts (`python -m workers.slurm_agent`) run it. Everything goes through the REST API."""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from api.stack import Stack
from db import ingest as dbi
from db.connection import session_for
from db.models import Job
from tests.conftest import TINY_SPEC, StackHandle, long_job, running
from tests.integration.test_gang import SPEC as GANG_SPEC
from tests.integration.test_gang import STEPS as GANG_STEPS
from tests.integration.test_gang import assert_same_losses, reference_run, reference_series
from tests.proc_tree import process_tree

pytestmark = pytest.mark.slurm

PREFIX = f"sy{secrets.token_hex(3)}"
POOL = {
    "name": "main",
    "partition": "main",
    "nodes": 2,
    "slots_per_node": 2,
    "job_prefix": PREFIX,
    "signal_s": 60,
    "time_limit_s": 600,
}


def squeue() -> dict[int, tuple[int, str, str]]:
    """This module's Slurm jobs: Shardyard job id -> (Slurm job id, state, reason)."""
    out = subprocess.run(
        ["squeue", "-h", "-o", "%i|%j|%T|%r"], capture_output=True, text=True, check=True
    ).stdout
    got = {}
    for line in out.splitlines():
        sid, name, state, reason = line.split("|")
        if name.startswith(PREFIX + "-"):
            got[int(name.rsplit("-", 1)[1])] = (int(sid), state, reason)
    return got


def scancel_ours() -> None:
    ids = [str(sid) for sid, _, _ in squeue().values()]
    if ids:
        subprocess.run(["scancel", *ids], check=False)


@pytest.fixture(scope="module")
def pool(tmp_path_factory: pytest.TempPathFactory) -> Iterator[StackHandle]:
    root = tmp_path_factory.mktemp("slurm-stack")
    env = {
        "SHARDYARD_SLURM_POOLS": json.dumps([POOL]),
        "SHARDYARD_SLURM_POLL_S": "0.5",
        "SHARDYARD_HEARTBEAT_S": "1",
        "SHARDYARD_LEASE_S": "10",
        "SHARDYARD_RECONCILE_S": "2",
        "SHARDYARD_WARM_TRAINER": "false",
        "OMP_NUM_THREADS": "1",
    }
    st = Stack(root=root, workers=0, extra_env=env)
    with running(st) as h:
        st._spawn("slurm-pool", [sys.executable, "-m", "workers.slurm_pool"])
        try:
            yield h
        finally:
            scancel_ours()
            for log in sorted(Path(root).glob("slurm/*.out")) + [root / "slurm-pool.log", root / "api.log"]:
                if log.exists():
                    print(f"---- {log.name}\n{log.read_text()[-4000:]}")


def _logs(h: StackHandle, job_id: int) -> list[dict[str, Any]]:
    return h.client.get(f"/api/jobs/{job_id}/logs").json()["items"]


def _slurm_ids(h: StackHandle, job_id: int) -> list[int]:
    return [e["data"]["slurm_job_id"] for e in _logs(h, job_id) if (e.get("data") or {}).get("slurm_job_id")]


def test_a_one_node_job_succeeds(pool: StackHandle) -> None:
    job = pool.submit({**TINY_SPEC, "name": "slurm-one"})
    done = pool.wait(job["id"], timeout=240)  # the pool's first sbatch, a cold agent and trainer
    assert done["worker"].startswith("slurm:main:"), done["worker"]
    assert _slurm_ids(pool, job["id"]), _logs(pool, job["id"])
    got = pool.client.get(f"/api/jobs/{job['id']}/metrics", params={"names": "loss"}).json()
    assert got["series"]["loss"]["steps"] == list(range(1, TINY_SPEC["train"]["steps"] + 1))
    # its trainer was given the one CPU of its allocation (srun --cpus-per-task, workers/cores.py)
    stderr = (pool.stack.root / "jobs" / str(job["id"]) / "stderr.log").read_text()
    assert "trainer: 1 torch thread(s), of the 1 core(s) its worker gave this run" in stderr, stderr
    # its Slurm job ends with it
    deadline = time.monotonic() + 30
    while job["id"] in squeue() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert job["id"] not in squeue()


def test_rest_cancel_removes_it_from_squeue(pool: StackHandle) -> None:
    job = pool.submit(long_job("slurm-cancel", 3000))
    pool.wait_until(job["id"], lambda j: j["status"] == "running" and j["progress"]["step"] >= 3, timeout=120)
    assert job["id"] in squeue()
    r = pool.client.post(f"/api/jobs/{job['id']}/cancel")
    assert r.status_code == 200, r.text
    t0 = time.monotonic()
    while job["id"] in squeue() and time.monotonic() - t0 < 20:
        time.sleep(0.2)
    assert job["id"] not in squeue(), squeue()
    done = pool.wait(job["id"], ("cancelled",), timeout=60)
    assert done["status"] == "cancelled"


def test_a_job_too_big_for_the_partition_waits_with_slurms_reason(pool: StackHandle) -> None:
    """The partition's MaxTime is 30 minutes (tests/slurm/cluster.sh): a job that may run two
    hours is submitted and stays pending, its wait reason Slurm's own."""
    job = pool.submit({**TINY_SPEC, "name": "slurm-too-long", "max_runtime_s": 7200})
    got = pool.wait_until(job["id"], lambda j: "PartitionTimeLimit" in (j["wait_reason"] or ""), timeout=60)
    assert got["status"] == "queued"
    sid, state, reason = squeue()[job["id"]]
    assert (state, reason) == ("PENDING", "PartitionTimeLimit")
    assert got["wait_reason"] == f"slurm job {sid} pending in partition main: PartitionTimeLimit"
    assert sid in _slurm_ids(pool, job["id"])
    r = pool.client.post(f"/api/jobs/{job['id']}/cancel")
    assert r.status_code == 200 and r.json()["status"] == "cancelled", r.text
    t0 = time.monotonic()
    while job["id"] in squeue() and time.monotonic() - t0 < 10:
        time.sleep(0.2)
    assert job["id"] not in squeue()


def _applied_step(h: StackHandle, job_id: int) -> int:
    with session_for(h.stack.database_url) as s:
        return s.get(Job, job_id).applied_step or 0


def _running_past_a_checkpoint(pool: StackHandle, name: str, steps: int) -> tuple[int, int]:
    """A long job submitted to the pool, once it runs and a checkpoint of it (step 20) is applied:
    (its id, its Slurm job's id)."""
    jid = pool.submit(long_job(name, steps, checkpoint_every=20))["id"]
    pool.wait_until(jid, lambda j: j["status"] == "running" and j["progress"]["step"] >= 25, timeout=120)
    deadline = time.monotonic() + 60
    while _applied_step(pool, jid) < 20:
        assert time.monotonic() < deadline, "no checkpoint of the job was applied"
        time.sleep(0.1)
    return jid, squeue()[jid][0]


def test_scontrol_requeue_resumes_from_the_checkpoint(pool: StackHandle) -> None:
    """`scontrol requeue` of a running job: Slurm sends SIGTERM to the step; the agent has the
    trainer checkpoint and gives the job back; the requeued Slurm job waits out its BeginTime
    (shown as the wait reason), runs again and its agent resumes from the checkpoint. Every
    loss step is stored once."""
    steps = 400
    jid, sid = _running_past_a_checkpoint(pool, "slurm-requeue", steps)
    subprocess.run(["scontrol", "requeue", str(sid)], check=True)
    back = pool.wait_until(jid, lambda j: "BeginTime" in (j["wait_reason"] or ""), timeout=60)
    assert back["status"] == "queued" and back["attempts"] == 1, back
    messages = [e["message"] for e in _logs(pool, jid)]
    assert any("SIGTERM" in m for m in messages), messages
    # the requeued job would wait Slurm's requeue delay (two minutes): started now instead
    subprocess.run(["scontrol", "update", f"JobId={sid}", "StartTime=now"], check=True)
    done = pool.wait(jid, timeout=240)
    assert done["attempts"] == 2
    got = pool.client.get(f"/api/jobs/{jid}/metrics", params={"names": "loss"}).json()
    assert got["series"]["loss"]["steps"] == list(range(1, steps + 1))
    messages = [e["message"] for e in _logs(pool, jid)]
    assert any(m.startswith("resumed from step-") for m in messages), messages
    assert _slurm_ids(pool, jid) and set(_slurm_ids(pool, jid)) == {sid}


def test_a_two_node_gang_matches_the_one_node_run(pool: StackHandle, tmp_path: Path) -> None:
    """A 4-rank job (pipeline 2 x data parallel 2) on a pool of 2-slot nodes: the scheduler shapes
    a gang of two, Slurm allocates n1 and n2, each node agent runs its node through
    execute_gang_node (rendezvous on the allocation's first node), and every loss and val_loss
    step is the one-node 4-rank run's, once."""
    ref = reference_run(tmp_path / "reference")
    try:
        job = pool.submit({**GANG_SPEC, "name": "slurm-gang"})
        jid = job["id"]
        running_job = pool.wait_until(jid, lambda j: j["status"] in ("running", "succeeded"), timeout=120)
        done = pool.wait(jid, timeout=300)
        want = reference_series(ref)
    finally:
        if ref.poll() is None:
            ref.kill()
    assert done["attempts"] == 1 and done["result"]["steps"] == GANG_STEPS
    assert running_job["status"] == "succeeded" or len(running_job["reservation"]) == 2, running_job
    messages = [e["message"] for e in _logs(pool, jid)]
    assert any(m.startswith("slurm job") and "2 node(s) x 2 task(s)" in m for m in messages), messages
    assert any(m.startswith("slurm job") and "started on n[1-2]" in m for m in messages), messages
    with session_for(pool.stack.database_url) as s:
        got = dbi.metric_series(s, job_id=jid, names=["loss", "val_loss"])
    assert_same_losses(got, want)


def _pids_of(pattern: bytes) -> list[int]:
    found = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if pattern in (d / "cmdline").read_bytes():
                    found.append(int(d.name))
            except OSError:
                continue
    return found


def _slurmd(node: str) -> list[int]:
    return _pids_of(b"slurmd\0-D\0-N\0" + node.encode() + b"\0")


def _idle(node: str) -> bool:
    out = subprocess.run(["sinfo", "-h", "-n", node, "-o", "%t"], capture_output=True, text=True).stdout
    return out.strip() == "idle"


def test_a_node_lost_mid_job_is_retried_from_its_checkpoint(pool: StackHandle) -> None:
    """The node a job runs on dies: its slurmd and every process of the Slurm job's steps killed
    (SIGKILL). The job's lease runs out and it goes back to the queue, counted as a restart;
    Slurm marks the node down (SlurmdTimeout), and requeues its job (`--requeue`), which runs on
    the other node, resumes from the checkpoint and succeeds with every loss step once. The
    node's slurmd is started again at the end (tests/slurm/cluster.sh stops it)."""
    steps = 400
    jid, sid = _running_past_a_checkpoint(pool, "slurm-node-lost", steps)
    node = subprocess.run(["squeue", "-h", "-j", str(sid), "-o", "%N"], capture_output=True, text=True).stdout
    node = node.strip()
    assert node in ("n1", "n2"), node
    conf = Path(os.environ["SLURM_CONF"])
    (slurmd,) = _slurmd(node)
    steps_pids = _pids_of(f"slurmstepd: [{sid}.".encode())
    assert steps_pids, "the job's slurmstepd processes"
    victims = [slurmd, *process_tree(steps_pids)]
    for pid in victims:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    try:
        back = pool.wait_until(jid, lambda j: j["status"] == "queued", timeout=60)
        assert back["restarts"] == 1, back
        # Slurm sees the node gone after SlurmdTimeout and requeues the job on the other one
        pool.wait_until(jid, lambda j: "BeginTime" in (j["wait_reason"] or ""), timeout=120)
        subprocess.run(["scontrol", "update", f"JobId={sid}", "StartTime=now"], check=True)
        done = pool.wait(jid, timeout=240)
        assert done["attempts"] == 2 and done["restarts"] == 1
        got = pool.client.get(f"/api/jobs/{jid}/metrics", params={"names": "loss"}).json()
        assert got["series"]["loss"]["steps"] == list(range(1, steps + 1))
        messages = [e["message"] for e in _logs(pool, jid)]
        assert any(m.startswith("resumed from step-") for m in messages), messages
        other = "n2" if node == "n1" else "n1"
        assert any(m.startswith(f"slurm job {sid} started on {other}") for m in messages), messages
    finally:
        again = subprocess.Popen(
            ["slurmd", "-D", "-N", node, "-f", str(conf)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        with (conf.parent / "pids").open("a") as f:
            f.write(f"{again.pid}\n")
        deadline = time.monotonic() + 60
        while not _idle(node) and time.monotonic() < deadline:
            time.sleep(0.5)
    assert _idle(node), f"{node} did not come back"


def test_a_selection_batch_with_asha_runs_in_the_pool(pool: StackHandle) -> None:
    """Six trials in two groups of three, each on two devices (one pool node's slots): the
    scheduler reserves the groups on the two pool nodes at once; each group is one Slurm job whose
    agent runs it through execute_selection; ASHA stops some trials early and the batch succeeds
    with a full leaderboard."""
    base = {**TINY_SPEC, "name": "slurm-sel", "train": {**TINY_SPEC["train"], "steps": 24, "eval_every": 4}}
    body = {
        "name": "slurm-asha",
        "base": base,
        "space": {"train.lr": [1e-4, 3e-4, 1e-3, 3e-3, 6e-3, 1e-2]},
        "method": "grid",
        "devices": 2,
        "group_size": 3,
        "early_stopping": {"kind": "asha", "reduction_factor": 3, "min_steps": 4},
    }
    sel = pool.submit_selection(body)
    done = pool.wait_selection(sel["id"], timeout=300)
    assert done["status"] == "succeeded", done
    trials = done["trials"]
    assert all(t["status"] in ("succeeded", "stopped_early") for t in trials), trials
    assert any(t["stopped_early"] for t in trials), "ASHA with reduction factor 3 over 6 trials stops some"
    assert len(done["leaderboard"]) == 6
    nodes = {pool.job(t["job_id"])["worker"] for t in trials}
    assert all(n.startswith("slurm:main:") for n in nodes), nodes
    assert len(nodes) == 2, f"the groups ran on both of the pool's nodes: {nodes}"
    # each group's Slurm job is in its first trial's log, and it ended with its group: the
    # nodes went back to the cluster within seconds of the batch's end
    groups = {sid for t in trials for sid in _slurm_ids(pool, t["job_id"])}
    assert groups, "no trial's log names a Slurm job"
    deadline = time.monotonic() + 15
    while groups & {sid for sid, _, _ in squeue().values()} and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not groups & {sid for sid, _, _ in squeue().values()}, squeue()


def test_a_slurm_job_that_vanishes_requeues_the_job_with_slurms_word(pool: StackHandle) -> None:
    """The agent of a running job and every process under it killed at once (SIGKILL: it hears no
    stop): srun sees its step fail and the Slurm job ends, and the submitter gives the job back
    (before its lease runs out), counted as a restart, its reason Slurm's state of the job; a new
    Slurm job runs it to its end from the checkpoint."""
    steps = 300
    jid, sid = _running_past_a_checkpoint(pool, "slurm-vanish", steps)
    step = _pids_of(f"slurmstepd: [{sid}.0]".encode())
    assert step, "the agent's step"
    for pid in [p for p in process_tree(step) if p not in step]:  # slurmstepd sees its task killed
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    back = pool.wait_until(jid, lambda j: j["restarts"] == 1, timeout=30)
    assert back["status"] in ("queued", "running"), back
    events = pool.client.get(f"/api/jobs/{jid}/logs").json()["items"]
    reasons = [(e.get("data") or {}).get("reason", "") for e in events if e["kind"] == "status"]
    assert any(r.startswith(f"slurm job {sid} vanished (") for r in reasons), reasons
    done = pool.wait(jid, timeout=240)
    assert done["attempts"] == 2
    got = pool.client.get(f"/api/jobs/{jid}/metrics", params={"names": "loss"}).json()
    assert got["series"]["loss"]["steps"] == list(range(1, steps + 1))
    ids = _slurm_ids(pool, jid)
    assert sid in ids and len(set(ids)) == 2, ids


def test_the_time_limit_signal_gives_the_job_back_to_a_new_slurm_job(pool: StackHandle) -> None:
    """SIGUSR1 to a running job's steps, as `--signal=USR1@<s>` sends it before the time limit
    (sent here at once with `scancel --signal=USR1`): the agent has the trainer checkpoint, gives
    the job back and exits, its Slurm job ends, and the submitter submits a new one, which resumes
    from the checkpoint; every loss step is stored once and no restart is counted."""
    steps = 300
    jid, sid = _running_past_a_checkpoint(pool, "slurm-usr1", steps)
    subprocess.run(["scancel", "--signal=USR1", str(sid)], check=True)
    done = pool.wait(jid, timeout=240)
    assert done["attempts"] == 2 and done["restarts"] == 0, done
    got = pool.client.get(f"/api/jobs/{jid}/metrics", params={"names": "loss"}).json()
    assert got["series"]["loss"]["steps"] == list(range(1, steps + 1))
    messages = [e["message"] for e in _logs(pool, jid)]
    assert any("SIGUSR1" in m for m in messages), messages
    assert any(m.startswith("resumed from step-") for m in messages), messages
    ids = _slurm_ids(pool, jid)
    assert sid in ids and len(set(ids)) == 2, ids
