"""End to end through real processes: HTTP -> SQLite -> Redis -> Celery worker -> trainer
subprocess -> metrics in the database and on the SSE stream."""

from __future__ import annotations

import threading

import pytest

from core.broker import TASK_RUN_JOB, celery_client
from tests.conftest import TINY_SPEC, StackHandle
from tests.sse import read_sse

pytestmark = pytest.mark.integration


def test_job_trains_on_real_text_and_streams_its_metrics(stack: StackHandle) -> None:
    job = stack.submit({**TINY_SPEC, "name": "e2e"})
    assert job["status"] == "queued"
    # open the stream at once: it must replay what happened before and relay the rest live
    live: list = []
    t = threading.Thread(
        target=lambda: live.extend(read_sse(stack.base_url, f"/api/jobs/{job['id']}/stream"))
    )
    t.start()
    done = stack.wait(job["id"], timeout=180)
    t.join(timeout=60)
    assert not t.is_alive(), "the stream did not close after the job ended"

    assert done["attempts"] == 1 and done["worker"]
    assert done["result"]["steps"] == TINY_SPEC["train"]["steps"]
    stored = stack.client.get(f"/api/jobs/{job['id']}/metrics", params={"names": "loss,val_loss"}).json()
    loss = stored["series"]["loss"]
    assert loss["steps"] == list(range(1, 41))
    first, last = sum(loss["values"][:5]) / 5, sum(loss["values"][-5:]) / 5
    assert last < first - 0.5, f"loss did not fall: {first:.3f} -> {last:.3f}"
    assert stored["series"]["val_loss"]["steps"] == [20, 40]

    streamed = [(d["step"], d["value"]) for _, ev, d in live if ev == "metric" and d["name"] == "loss"]
    assert streamed == list(zip(loss["steps"], loss["values"], strict=True))
    statuses = [d["status"] for _, ev, d in live if ev == "status"]
    assert statuses[-1] == "succeeded" and "running" in statuses
    ids = [fid for fid, ev, _ in live if ev == "metric"]
    assert len(ids) == len(set(ids)), "a metric frame was sent twice"

    logs = stack.client.get(f"/api/jobs/{job['id']}/logs").json()["items"]
    assert any("parameters" in e["message"] for e in logs)


def test_stream_resumes_from_last_event_id(stack: StackHandle) -> None:
    job = stack.submit({**TINY_SPEC, "name": "resume", "train": {**TINY_SPEC["train"], "steps": 10}})
    stack.wait(job["id"])
    path = f"/api/jobs/{job['id']}/stream"
    everything = read_sse(stack.base_url, path)
    first = read_sse(stack.base_url, path, stop_after=7)
    rest = read_sse(stack.base_url, path, last_event_id=first[-1][0])
    assert [f[1:] for f in first + rest] == [f[1:] for f in everything]


def test_metrics_are_downsampled_on_request(stack: StackHandle) -> None:
    job = stack.submit({**TINY_SPEC, "name": "downsample"})
    stack.wait(job["id"])
    full = stack.client.get(f"/api/jobs/{job['id']}/metrics", params={"names": "loss"}).json()
    small = stack.client.get(
        f"/api/jobs/{job['id']}/metrics", params={"names": "loss", "max_points": 10}
    ).json()
    steps = small["series"]["loss"]["steps"]
    assert len(steps) == 10 and steps[0] == 1 and steps[-1] == 40
    by_step = dict(zip(full["series"]["loss"]["steps"], full["series"]["loss"]["values"], strict=True))
    assert all(by_step[s] == v for s, v in zip(steps, small["series"]["loss"]["values"], strict=True))
    since = stack.client.get(
        f"/api/jobs/{job['id']}/metrics", params={"names": "loss", "since_step": 35}
    ).json()
    assert since["series"]["loss"]["steps"] == [35, 36, 37, 38, 39, 40]


def test_cancel_stops_a_running_job_within_a_step(stack: StackHandle) -> None:
    long = {**TINY_SPEC, "name": "long", "train": {**TINY_SPEC["train"], "steps": 1_000_000}}
    job = stack.submit(long)
    stack.wait_until(job["id"], lambda j: j["status"] == "running" and j["progress"]["step"] > 3, timeout=120)
    resp = stack.client.post(f"/api/jobs/{job['id']}/cancel")
    assert resp.status_code == 200 and resp.json()["cancel_requested"]
    done = stack.wait(job["id"], statuses=("cancelled",), timeout=60)
    assert done["finished_at"] is not None
    assert done["progress"]["step"] < 1_000_000
    again = stack.client.post(f"/api/jobs/{job['id']}/cancel")
    assert again.status_code == 409 and "already cancelled" in again.json()["detail"]


def test_a_failing_trainer_ends_failed_with_the_reason(stack: StackHandle) -> None:
    diverge = {
        **TINY_SPEC,
        "name": "diverge",
        "train": {**TINY_SPEC["train"], "lr": 10.0, "optimizer": "sgd"},
    }
    job = stack.submit(diverge)
    done = stack.wait(job["id"], statuses=("failed",), timeout=120)
    assert "loss is nan" in done["error"] or "loss is inf" in done["error"], done["error"]
    assert done["attempts"] == 1, "a NaN loss is terminal, not retried"


def test_the_same_message_delivered_twice_runs_the_job_once(stack: StackHandle) -> None:
    job = stack.submit({**TINY_SPEC, "name": "twice", "train": {**TINY_SPEC["train"], "steps": 15}})
    # a second delivery of the very same task (what a broker redelivery looks like)
    celery_client(stack.stack.broker_url, 3600).send_task(TASK_RUN_JOB, args=[job["id"]], queue="cpu")
    done = stack.wait(job["id"])
    assert done["attempts"] == 1
    loss = stack.client.get(f"/api/jobs/{job['id']}/metrics", params={"names": "loss"}).json()
    assert loss["series"]["loss"]["steps"] == list(range(1, 16)), "steps were recorded twice"
    logs = stack.client.get(f"/api/jobs/{job['id']}/logs").json()["items"]
    assert [e["message"] for e in logs if e["kind"] == "status"].count("running") == 1


def test_unknown_job_is_404_and_list_filters_by_status(stack: StackHandle) -> None:
    assert stack.client.get("/api/jobs/999999").status_code == 404
    assert stack.client.post("/api/jobs/999999/cancel").status_code == 404
    assert stack.client.get("/api/jobs/999999/metrics").status_code == 404
    job = stack.submit({**TINY_SPEC, "name": "listed", "train": {**TINY_SPEC["train"], "steps": 5}})
    stack.wait(job["id"])
    page = stack.client.get("/api/jobs", params={"status": "succeeded", "limit": 500}).json()
    assert job["id"] in [j["id"] for j in page["items"]]
    assert all(j["status"] == "succeeded" for j in page["items"])
    assert stack.client.get("/api/jobs", params={"status": "bogus"}).status_code == 422


def test_health_reports_db_broker_and_the_worker(stack: StackHandle) -> None:
    h = stack.client.get("/api/health").json()
    assert h["status"] == "ok" and h["db"]["ok"] and h["broker"]["ok"]
    assert h["workers"] and {"cpu", "gpu"} <= set(h["workers"][0]["queues"])
    assert any(d["type"] == "cpu" for d in h["workers"][0]["devices"])


def test_a_gpu_job_is_refused_when_no_worker_has_a_gpu(stack: StackHandle) -> None:
    workers = stack.client.get("/api/health").json()["workers"]
    gpus = max(sum(d["type"] == "cuda" for d in w["devices"]) for w in workers)
    spec = {**TINY_SPEC, "resources": {"device": "cuda", "gpus": gpus + 1}}
    resp = stack.client.post("/api/jobs", json=spec)
    assert resp.status_code == 422
    assert "resources.gpus" in resp.json()["detail"]
