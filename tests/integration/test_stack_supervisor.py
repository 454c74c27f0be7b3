"""The embedded stack survives its own processes: `shardyard stack` restarts a process that died
(with a back-off and one log line per restart), and stops only on Ctrl-C/SIGTERM or a crash
loop. Real processes throughout: the Celery worker is killed with SIGKILL, redis-server too, and a
worker that cannot start (a broken setting) dies at once on every restart."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
import redis

from api.stack import CrashLoop, RestartPolicy, Stack, free_port
from tests.conftest import LOST_WORKER_WINDOWS, TINY_SPEC, StackHandle, long_job
from tests.stack_cli import left_behind, proc_info, sigterm_and_wait, start_stack_cli
from tests.user_data import held_data, upload_held

pytestmark = pytest.mark.integration

# a dead worker's job is taken back within seconds (as in test_faults.py)
FAST = LOST_WORKER_WINDOWS
STEPS = 100


def _children(pid: int, marker: str) -> list[int]:
    found = []
    for d in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmd, _, state, ppid = proc_info(d)
        except OSError:
            continue
        if ppid == pid and marker in cmd and state != "Z":
            found.append(int(d))
    return found


def _answers(h: StackHandle) -> bool:
    try:
        return h.client.get("/api/health").status_code == 200
    except httpx.TransportError:
        return False


def _alive(pid: int) -> bool:
    try:
        return proc_info(pid)[2] != "Z"
    except OSError:
        return False


def test_sigkill_of_the_worker_is_restarted_and_the_job_ends_once(tmp_path: Path, gate: Path) -> None:
    root = tmp_path / "root"
    port = free_port()
    log = tmp_path / "stack.log"
    proc, auth = start_stack_cli(root, port, log, env=FAST)
    api = httpx.Client(base_url=f"http://127.0.0.1:{port}", headers=auth, timeout=30)
    try:
        (worker,) = _children(proc.pid, "worker1@")
        (uvicorn,) = _children(proc.pid, "uvicorn")
        # held at its 20th batch until its second attempt has claimed it (tests/user_data.py): the
        # kill lands mid-job whatever the machine's speed
        spec = {
            **long_job("supervised", STEPS, checkpoint_every=10),
            **held_data(upload_held(SimpleNamespace(client=api)), gate, hold_at=20),
        }
        job_id = api.post("/api/jobs", json=spec).json()["id"]
        deadline = time.monotonic() + 180
        while api.get(f"/api/jobs/{job_id}").json()["progress"]["step"] < 15:
            assert time.monotonic() < deadline, "the job did not reach step 15"
            time.sleep(0.2)
        os.kill(worker, signal.SIGKILL)  # the worker's main process only, as `kill -9 PID` does

        deadline = time.monotonic() + 300
        while (job := api.get(f"/api/jobs/{job_id}").json())["status"] != "succeeded":
            if job["attempts"] >= 2:
                gate.unlink(missing_ok=True)
            # the stack and its API carry on while the worker is restarted and the job resumes
            assert proc.poll() is None, log.read_text()[-3000:]
            assert api.get("/api/health").status_code == 200
            assert job["status"] in ("queued", "running"), job
            assert time.monotonic() < deadline, f"the job did not finish after the restart: {job}"
            time.sleep(0.5)
        loss = api.get(f"/api/jobs/{job_id}/metrics", params={"names": "loss"}).json()
        logs = [e["message"] for e in api.get(f"/api/jobs/{job_id}/logs").json()["items"]]
        (restarted,) = _children(proc.pid, "worker1@")
        assert _children(proc.pid, "uvicorn") == [uvicorn], "only the dead process is restarted"
        rc = sigterm_and_wait(proc, root)
    finally:
        api.close()
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    out = log.read_text()
    assert "worker1 exited with -9 (SIGKILL); restarting in 1s (restart 1)" in " ".join(out.split()), out[
        -3000:
    ]
    assert restarted != worker
    assert loss["series"]["loss"]["steps"] == list(range(1, STEPS + 1))
    assert job["attempts"] == 2 and job["result"]["steps"] == STEPS
    assert any(m.startswith("resumed from step-") for m in logs), logs
    assert rc == 143 and left_behind(root) == [], out[-3000:]


def test_redis_server_is_restarted_and_unclaimed_tasks_are_sent_again(tmp_path: Path) -> None:
    """A job's task waits in redis-server for a worker that was killed (and still counts as
    alive for the scheduler), then redis-server is killed too; the supervisor restarts both. The
    restarted redis-server is empty: without the re-send the task would come back only after
    requeue_after_s (10 minutes); with it the job runs on the restarted worker at once."""
    st = Stack(
        root=tmp_path,
        extra_env={"SHARDYARD_WORKER_ALIVE_S": "600", "SHARDYARD_HEARTBEAT_S": "0.5"},
        restarts=RestartPolicy(backoff_s=0.2),
    )
    st.start()
    h = StackHandle(st)
    lines: list[str] = []
    stop = threading.Event()
    thread = threading.Thread(target=st.supervise, kwargs={"stop": stop, "say": lines.append, "poll_s": 0.2})
    try:
        # no consumer: a stopped (SIGSTOP) worker may already hold the message in its socket
        os.killpg(st.procs["worker1"].pid, signal.SIGKILL)
        job = h.submit({**TINY_SPEC, "train": {**TINY_SPEC["train"], "steps": 10}})
        broker = redis.Redis.from_url(st.broker_url)  # (its password with it)
        deadline = time.monotonic() + 60
        while not any(broker.type(k) == b"list" and broker.llen(k) for k in broker.keys()):
            assert time.monotonic() < deadline, f"no task in redis-server: {broker.keys()}"
            time.sleep(0.2)
        broker.close()
        os.kill(st.procs["redis"].pid, signal.SIGKILL)
        st.procs["redis"].wait()
        thread.start()
        done = h.wait(job["id"], timeout=180)
    finally:
        stop.set()
        if thread.is_alive():
            thread.join(60)
        h.client.close()
        st.stop()
    assert done["attempts"] == 1
    assert lines[:2] == [
        "redis exited with -9 (SIGKILL); restarting in 0.2s (restart 1)",
        "worker1 exited with -9 (SIGKILL); restarting in 0.2s (restart 1)",
    ], lines
    assert "redis-server restarted empty: 1 unclaimed task(s) will be sent again" in lines, lines


def test_a_killed_api_comes_back_on_its_port(tmp_path: Path) -> None:
    """kill -9 of uvicorn: the supervisor kills what is left of its group (the scheduler process)
    and starts the API again on the same port; its scheduler places work again."""
    st = Stack(root=tmp_path, restarts=RestartPolicy(backoff_s=0.2))
    st.start()
    h = StackHandle(st)
    lines: list[str] = []
    stop = threading.Event()
    thread = threading.Thread(target=st.supervise, kwargs={"stop": stop, "say": lines.append, "poll_s": 0.2})
    thread.start()
    old = st.procs["api"]
    try:
        scheduler = _children(old.pid, "core.scheduler_proc")
        assert len(scheduler) == 1
        os.kill(old.pid, signal.SIGKILL)
        deadline = time.monotonic() + 120
        while st.procs["api"] is old or not _answers(h):
            assert time.monotonic() < deadline, f"the API was not restarted: {lines}"
            time.sleep(0.2)
        done = h.wait(h.submit({**TINY_SPEC, "train": {**TINY_SPEC["train"], "steps": 5}})["id"], timeout=180)
        gone = not _alive(scheduler[0])
    finally:
        stop.set()
        thread.join(60)
        h.client.close()
        st.stop()
    assert done["status"] == "succeeded"
    assert gone, "the dead API's scheduler process outlived it"
    assert lines == ["api exited with -9 (SIGKILL); restarting in 0.2s (restart 1)"], lines
    assert left_behind(tmp_path) == []


def test_a_process_that_dies_at_once_every_time_ends_the_stack(tmp_path: Path) -> None:
    """The worker is killed once; from then on its setting is broken, so every restart exits at
    once (a validation error, exit code 2). After max_restarts restarts within the window the
    supervisor gives up with the reason; the API and redis-server were never touched."""
    policy = RestartPolicy(backoff_s=0.2, max_backoff_s=1.0, max_restarts=3, window_s=120)
    st = Stack(root=tmp_path, restarts=policy)
    st.start()
    lines: list[str] = []
    give_up = threading.Timer(240, lambda: stop.set())
    stop = threading.Event()
    try:
        api, redis_proc = st.procs["api"], st.procs["redis"]
        st.extra_env["SHARDYARD_WORKER_SLOTS"] = "many"  # read by the next process started
        os.killpg(st.procs["worker1"].pid, signal.SIGKILL)
        give_up.start()
        with pytest.raises(CrashLoop) as caught:
            st.supervise(stop=stop, say=lines.append, poll_s=0.2)
        assert api.poll() is None and redis_proc.poll() is None
    finally:
        give_up.cancel()
        st.stop()
    reason = str(caught.value)
    assert reason.startswith("worker1 exited 4 times within 120s (last with 2): a crash loop"), reason
    assert lines == [
        "worker1 exited with -9 (SIGKILL); restarting in 0.2s (restart 1)",
        "worker1 exited with 2; restarting in 0.4s (restart 2)",
        "worker1 exited with 2; restarting in 0.8s (restart 3)",
    ]
    assert "worker_slots" in (tmp_path / "worker1.log").read_text()
    assert left_behind(tmp_path) == []
