"""The whole topology in containers of the project's image (tests/containers/topology.py): the API,
the scheduler and two workers with no disk in common, storage in an S3-API server. Everything is
driven and read through REST, as a user of a real deployment would.

In order (one topology for the module; each test leaves both workers idle for the next):
- every container's HEALTHCHECK passes, both workers' trainers run in their sandbox
  (/api/health's sandbox "on") and a job succeeds;
- a 2-node gang, one rank in each worker container, matches the same job run on one node;
- a selection batch runs one group in each worker container;
- a hostile workspace (tests/hostile_src.py) trains in a worker container and reaches nothing of
  it: no credential, no other job's folder, no cached archive, no Postgres, Redis, API or store port;
- a workspace job runs on a worker whose disk never held the upload, while the other worker runs a
  long job; that worker's container is then killed (SIGKILL) mid-job, and the job resumes in the
  other container from its checkpoint in the store, every loss step exactly once.
"""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest
import torch

from tests.archives import targz, upload
from tests.conftest import TERMINAL, TINY_SPEC, long_job, loss_series
from tests.containers.topology import BUCKET, Topology, make_root
from tests.hostile_src import HOSTILE, hostile_report
from tests.user_data import PERIODIC_BATCHES_PY

pytestmark = pytest.mark.containers

STEPS = 12
TINY = {**TINY_SPEC, "name": "tiny", "train": {**TINY_SPEC["train"], "steps": STEPS, "eval_every": STEPS}}
GANG = {
    **TINY,
    "name": "gang",
    "parallel": {"data_parallel": 2},
    "checkpoint_every": 4,
}
DATA_PY = PERIODIC_BATCHES_PY

# the one-node reference: the command a worker runs for a 2-rank job, run inside a worker container
REFERENCE = """
import json, pathlib, subprocess, sys, tempfile
from workers.execute import trainer_command
root = pathlib.Path(tempfile.mkdtemp())
(root / "spec.json").write_text(sys.argv[1])
cmd = trainer_command(world_size=2, spec_path=root / "spec.json", ckpt_dir=root / "ckpt", stop_file=root / "stop")
sys.exit(subprocess.run(cmd, stderr=subprocess.DEVNULL).returncode)
"""


@pytest.fixture(scope="module")
def topo() -> Iterator[Topology]:
    t = Topology(make_root())
    # the gang test's one-node reference runs in a container of its own while the topology starts
    t.reference = t.run_once("python", "-c", REFERENCE, json.dumps(GANG))
    try:
        yield t.start()
    finally:
        if t.reference.poll() is None:
            t.reference.kill()
        t.close()


@pytest.fixture(autouse=True)
def _logs_on_failure(request: pytest.FixtureRequest, topo: Topology) -> Iterator[None]:
    yield
    rep = getattr(request.node, "rep_call", None)
    if rep is not None and rep.failed:
        topo.dump_logs()


def submit(t: Topology, spec: dict[str, Any]) -> int:
    resp = t.client.post("/api/jobs", json=spec)
    assert resp.status_code == 201, resp.text
    return resp.json()["id"]


def job(t: Topology, job_id: int) -> dict[str, Any]:
    return t.client.get(f"/api/jobs/{job_id}").json()


def wait(t: Topology, job_id: int, pred, what: str, timeout: float = 240) -> dict[str, Any]:  # noqa: ANN001
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        j = job(t, job_id)
        if pred(j):
            return j
        if j["status"] in TERMINAL:
            raise AssertionError(f"job {job_id} ended {j['status']} before {what}: {j['error']}")
        time.sleep(0.3)
    raise AssertionError(f"job {job_id}: not {what} within {timeout}s: {job(t, job_id)}")


def succeeded(t: Topology, job_id: int, timeout: float = 240) -> dict[str, Any]:
    return wait(t, job_id, lambda j: j["status"] == "succeeded", "succeeded", timeout)


def series(t: Topology, job_id: int) -> dict[str, Any]:
    got = t.client.get(f"/api/jobs/{job_id}/metrics", params={"names": "loss,val_loss"})
    return got.json()["series"]


def messages(t: Topology, job_id: int) -> list[str]:
    return [e["message"] for e in t.client.get(f"/api/jobs/{job_id}/logs").json()["items"]]


def store_keys(t: Topology, prefix: str) -> list[str]:
    """Keys in the S3 bucket under `prefix` (ListObjectsV2, as any S3 client lists them)."""
    resp = httpx.get(f"{t.s3_url}/{BUCKET}", params={"list-type": "2", "prefix": prefix}, timeout=10)
    assert resp.status_code == 200, resp.text
    return re.findall(r"<Key>([^<]+)</Key>", resp.text)


def test_every_container_is_healthy_and_a_job_succeeds(topo: Topology) -> None:
    for c in [topo.name("api"), topo.name("scheduler"), *topo.workers]:
        check = topo.healthcheck(c)
        assert check.returncode == 0, f"{c}: {check.stdout}{check.stderr}"
    # the workers' containers let bubblewrap make the trainers' sandbox (WORKER_OPTIONS)
    health = topo.client.get("/api/health").json()
    sandboxes = {w["name"]: (w["sandbox"], w["sandbox_why"]) for w in health["workers"]}
    assert {sandboxes[topo.celery_name(w)] for w in topo.workers} == {("on", None)}, sandboxes
    assert health["sandbox"] == "on", health
    job_id = submit(topo, TINY)
    done = succeeded(topo, job_id)
    assert done["worker"] in {topo.celery_name(w) for w in topo.workers}
    assert done["attempts"] == 1 and done["result"]["steps"] == STEPS
    assert series(topo, job_id)["loss"]["steps"] == list(range(1, STEPS + 1))


def reference(t: Topology) -> dict[str, tuple[list[int], list[float]]]:
    out, err = t.reference.communicate(timeout=300)
    assert t.reference.returncode == 0, f"the reference run failed: {err[-2000:]}"
    got = loss_series(out)
    assert got.get("loss"), f"the reference run printed no loss: {out[-2000:]}"
    return got


def test_a_two_node_gang_matches_the_one_node_run(topo: Topology) -> None:
    want = reference(topo)
    job_id = submit(topo, GANG)
    running = wait(topo, job_id, lambda j: len(j["reservation"]) == 2, "reserved on two nodes", timeout=120)
    nodes = {r["worker"] for r in running["reservation"]}
    assert nodes == {topo.celery_name(w) for w in topo.workers}, f"one rank in each container: {nodes}"
    done = succeeded(topo, job_id)
    assert done["attempts"] == 1 and done["world_size"] == 2
    got = series(topo, job_id)
    for name in ("loss", "val_loss"):
        assert got[name]["steps"] == want[name][0], f"{name}: each step exactly once"
        torch.testing.assert_close(torch.tensor(got[name]["values"]), torch.tensor(want[name][1]))


def test_a_selection_batch_spans_both_workers(topo: Topology) -> None:
    body = {
        "name": "sel",
        "base": TINY,
        "space": {"train.lr": [1e-3, 3e-3]},
        "method": "grid",
        "devices": 1,
        "group_size": 1,
    }
    # the test before this one ran a gang on both workers (one slot each): while a node of it
    # still holds its slot, group 0 goes to the free worker, ends there first, and group 1 follows
    deadline = time.monotonic() + 60
    while any(j["reservation"] for j in topo.client.get("/api/jobs", params={"limit": 100}).json()["items"]):
        assert time.monotonic() < deadline, "an earlier job still holds a worker's slot"
        time.sleep(0.2)
    resp = topo.client.post("/api/selections", json=body)
    assert resp.status_code == 201, resp.text
    sel = resp.json()
    deadline = time.monotonic() + 240
    while (done := topo.client.get(f"/api/selections/{sel['id']}").json())["status"] not in TERMINAL:
        assert time.monotonic() < deadline, f"selection {sel['id']} did not end: {done}"
        time.sleep(0.5)
    assert done["status"] == "succeeded", done
    workers = {job(topo, t["job_id"])["worker"] for t in done["trials"]}
    assert workers == {topo.celery_name(w) for w in topo.workers}, f"one group per container: {workers}"


def new_user(t: Topology) -> httpx.Client:
    resp = t.client.post("/api/users", json={"name": f"u{os.urandom(4).hex()}"})
    assert resp.status_code == 201, resp.text
    return httpx.Client(
        base_url=t.client.base_url, timeout=30, headers={"Authorization": f"Bearer {resp.json()['token']}"}
    )


def idle(t: Topology, timeout: float = 60) -> None:
    """Until no job holds a worker's slot."""
    deadline = time.monotonic() + timeout
    while any(j["reservation"] for j in t.client.get("/api/jobs", params={"limit": 100}).json()["items"]):
        assert time.monotonic() < deadline, "an earlier job still holds a worker's slot"
        time.sleep(0.2)


def test_a_hostile_workspace_trains_in_a_worker_container_and_reaches_nothing(topo: Topology) -> None:
    idle(topo)
    # another user's job ends on one worker while a long job holds the other's one slot, so the
    # hostile job lands beside the finished job's folder
    blocker = submit(topo, long_job("blocker", 3000, checkpoint_every=3000))
    try:
        with new_user(topo) as victim_user, new_user(topo) as hostile_user:
            hostile, worker, code = _hostile_job(topo, blocker, victim_user, hostile_user)
    finally:
        topo.client.post(f"/api/jobs/{blocker}/cancel")
    wait(topo, blocker, lambda j: j["status"] == "cancelled", "cancelled", timeout=120)

    report = hostile_report(topo.client, hostile)
    reached = {k: v for k, v in report.items() if not v.startswith("blocked")}
    assert not reached, f"the sandbox let users' code reach: {reached}"
    assert len(report) == 17, report
    loss = series(topo, hostile)["loss"]
    assert loss["steps"] == list(range(1, STEPS + 1)) and min(loss["values"]) > 0, "a printed fake loss"
    for planted in (f"{code}/planted.py", "/data/envs/planted.pth"):
        assert topo.exec(worker, "sh", "-c", f"test -e {planted} && echo planted || true") == "", planted
    idle(topo)


def _hostile_job(
    topo: Topology, blocker: int, victim_user: httpx.Client, hostile_user: httpx.Client
) -> tuple[int, str, str]:
    """The hostile job, run to its end beside another user's finished job: its id, its worker's
    container and where that container has the project's code."""
    resp = victim_user.post("/api/jobs", json={**TINY, "name": "victim"})
    assert resp.status_code == 201, resp.text
    victim = resp.json()["id"]
    victim_on = succeeded(topo, victim)["worker"]
    blocker_on = wait(topo, blocker, lambda j: j["status"] == "running", "running", timeout=120)["worker"]
    assert victim_on != blocker_on, f"the two jobs on one worker: {victim_on}"
    (worker,) = [w for w in topo.workers if topo.celery_name(w) == victim_on]
    other_job = f"/data/jobs/{victim}/spec.json"
    assert '"victim"' in topo.exec(worker, "cat", other_job), "the victim's folder is on the worker's disk"

    # what each escape aims at, as the worker's container has it
    code = topo.exec(worker, "python", "-c", "import os, trainer; print(os.path.dirname(trainer.__file__))")
    containers = (topo.name("api"), topo.name("scheduler"), *topo.workers)
    targets = {
        # the service's processes, by their ids on this machine and, for the worker's container,
        # by the ids its own PID namespace gives them: what an unsandboxed trainer there could
        # signal (the sandbox has a PID namespace of its own, inside the container's)
        "pids": [p for c in containers for p in topo.host_pids(c)]
        + topo.container_pids(worker)
        + [os.getpid()],
        # no database file on a worker (the embedded default's would be here): Postgres listens on a
        # port, tried below
        "database": "/data/shardyard.db",
        "data_dir": "/data",
        "other_job": other_job,
        # the worker's copies of the store's archives, the hostile one's own among them
        "archives": "/data/workspaces",
        "env_cache": "/data/envs",
        "code": code,
        "redis_port": topo.redis_port,
        "api_port": topo.api_port,
        "ports": {"Postgres": urlsplit(topo.database_url).port, "the store": urlsplit(topo.s3_url).port},
    }
    up = hostile_user.post(
        "/api/workspaces",
        params={"name": "evil"},
        content=targz({"evil/__init__.py": b"", "evil/model.py": HOSTILE.encode()}),
        headers={"content-type": "application/gzip"},
    )
    assert up.status_code == 201, up.text
    model = {"kind": "python", "entry": "evil.model:hostile", "args": {"targets": targets}, "seq_len": 32}
    resp = hostile_user.post(
        "/api/jobs", json={**TINY, "name": "hostile", "model": model, "workspace": up.json()["ref"]}
    )
    assert resp.status_code == 201, resp.text
    hostile = resp.json()["id"]
    done = succeeded(topo, hostile)
    assert done["worker"] == victim_on, "beside the victim's folder"
    assert done["result"]["final_loss"] > 0
    return hostile, worker, code


def test_workspace_job_on_the_other_worker_then_a_killed_worker_s_job_resumes(topo: Topology) -> None:
    steps, every = 300, 10
    long_id = submit(topo, long_job("long", steps, checkpoint_every=every))
    running_on = wait(topo, long_id, lambda j: j["status"] == "running", "running", timeout=120)["worker"]
    # the API names a worker by its Celery name; podman by its container's
    (first,) = [w for w in topo.workers if topo.celery_name(w) == running_on]
    (other,) = [w for w in topo.workers if w != first]

    # the upload reaches the API; the one worker with a free slot runs the job from the store
    up = upload(topo, targz({"mydata/__init__.py": b"", "mydata/source.py": DATA_PY}))
    assert up.status_code == 201, up.text
    ws = up.json()
    assert [k for k in store_keys(topo, "shardyard/workspaces/") if ws["digest"] in k], (
        "the upload is in the store"
    )
    data = {"kind": "python", "entry": "mydata.source:batches", "args": {"period": 13}, "vocab_size": 13}
    spec = {**TINY, "name": "ws", "data": data, "workspace": ws["ref"]}
    ws_done = succeeded(topo, submit(topo, spec))
    assert ws_done["worker"] == topo.celery_name(other)

    # the long job has a checkpoint in the store: kill its container
    wait(topo, long_id, lambda j: j["progress"]["step"] >= 2 * every + 2, f"past step {2 * every}")
    deadline = time.monotonic() + 60
    # the worker uploads a checkpoint once the trainer has written it: give it a moment
    while not store_keys(topo, f"shardyard/jobs/{long_id}/checkpoints/"):
        assert time.monotonic() < deadline, "no checkpoint of the long job reached the store"
        time.sleep(0.5)
    topo.kill(first)
    # the rest of the run: 200 s on a busy 2-core machine, so a generous bound
    done = succeeded(topo, long_id, timeout=600)
    assert done["worker"] == topo.celery_name(other) and done["attempts"] == 2
    assert any(m.startswith("resumed from step-") for m in messages(topo, long_id)), messages(topo, long_id)
    assert series(topo, long_id)["loss"]["steps"] == list(range(1, steps + 1)), "every loss step exactly once"
