"""Operators' metrics and users' webhooks on the real stack (redis-server, the API with its
scheduler child process, a Celery worker, real training): a scrape of /metrics while a job and a
batch run, and signed deliveries to receivers this test starts on loopback."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from api.stack import Stack
from core.webhooks import verify
from tests.conftest import TINY_SPEC, StackHandle, long_job, running
from tests.webhook_receiver import Receiver

pytestmark = pytest.mark.integration

BATCH = {
    "name": "ops-batch",
    "base": {**TINY_SPEC, "name": "b", "train": {**TINY_SPEC["train"], "steps": 12, "eval_every": 6}},
    "space": {"train.lr": [1e-3, 3e-3]},
    "method": "grid",
    "devices": 2,
}


@pytest.fixture(scope="module")
def ops(tmp_path_factory: pytest.TempPathFactory) -> Iterator[StackHandle]:
    """A stack of its own: webhooks to loopback receivers need the operator's allow-list, and
    short backoffs keep the retries inside the test."""
    root = tmp_path_factory.mktemp("ops")
    st = Stack(
        root=root,
        workers=1,
        concurrency=2,
        extra_env={
            "SHARDYARD_WEBHOOK_ALLOW": '["127.0.0.1/32"]',
            "SHARDYARD_WEBHOOK_BACKOFF_S": "0.3",
            "SHARDYARD_WEBHOOK_POLL_S": "0.2",
            # far past the test's length: a receiver that hangs must not be waited for
            "SHARDYARD_WEBHOOK_TIMEOUT_S": "600",
        },
    )
    with running(st) as handle:
        yield handle


def scrape(ops: StackHandle) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    resp = ops.client.get("/metrics")
    assert resp.status_code == 200, resp.text
    assert resp.headers["content-type"].startswith("text/plain")
    out = {}
    for fam in text_string_to_metric_families(resp.text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(m: dict, name: str, **labels: str) -> float:
    return m.get((name, tuple(sorted(labels.items()))), 0.0)


def total(m: dict, name: str, **labels: str) -> float:
    """Summed over the labels not given."""
    return sum(v for (n, ls), v in m.items() if n == name and all((k, lv) in ls for k, lv in labels.items()))


def user_client(ops: StackHandle, name: str) -> httpx.Client:
    made = ops.client.post("/api/users", json={"name": name})
    assert made.status_code == 201, made.text
    token = made.json()["token"]
    return httpx.Client(base_url=ops.base_url, timeout=30, headers={"Authorization": f"Bearer {token}"})


def wait_for(what: str, check, timeout: float = 240) -> Any:  # noqa: ANN001
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = check()
        if got:
            return got
        time.sleep(0.3)
    raise AssertionError(f"{what}: not after {timeout}s")


def test_metrics_are_for_admins_only(ops: StackHandle) -> None:
    assert httpx.get(f"{ops.base_url}/metrics").status_code == 401
    with user_client(ops, "not-an-admin") as c:
        resp = c.get("/metrics")
    assert resp.status_code == 403 and "admin" in resp.json()["detail"]


def test_a_scrape_during_a_job_and_a_batch_shows_states_and_latency_moving(ops: StackHandle) -> None:
    before = scrape(ops)
    # it runs until the test cancels it: a job of a set length could end before the scrape below
    # sees it running, or before the cancel (then it ends succeeded)
    job = ops.submit(long_job("scraped", 1_000_000))
    ops.wait(job["id"], ("running",), timeout=180)
    sel = ops.client.post("/api/selections", json=BATCH)
    assert sel.status_code == 201, sel.text
    sid = sel.json()["id"]
    # an open stream is counted while it is open
    with (
        httpx.Client(base_url=ops.base_url, headers=ops.headers, timeout=30) as c,
        c.stream("GET", f"/api/jobs/{job['id']}/stream") as stream,
    ):
        assert stream.status_code == 200
        during = wait_for(
            "a running job, a batch's trials at work and the stream counted",
            lambda: (
                m
                if value(m := scrape(ops), "shardyard_jobs", kind="job", status="running") >= 1
                and total(m, "shardyard_trials") >= 2
                and value(m, "shardyard_sse_open_streams") >= 1
                else None
            ),
        )
    assert value(during, "shardyard_workers_live") == 1
    worker = [ls for (n, ls) in during if n == "shardyard_worker_slots"][0]
    assert value(during, "shardyard_worker_slots", **dict(worker)) > 0
    assert value(during, "shardyard_worker_slots_reserved", **dict(worker)) >= 1
    assert total(during, "shardyard_worker_devices", type="cpu") >= 1
    assert value(during, "shardyard_db_pool_size") >= 1
    ops.client.post(f"/api/jobs/{job['id']}/cancel")
    ops.wait(job["id"], ("cancelled",), timeout=180)
    wait_for(
        "the batch to end",
        lambda: ops.client.get(f"/api/selections/{sid}").json()["status"] in ("succeeded", "failed"),
    )
    after = scrape(ops)
    ended = value(after, "shardyard_jobs", kind="job", status="cancelled")
    assert ended == value(before, "shardyard_jobs", kind="job", status="cancelled") + 1
    assert value(after, "shardyard_jobs", kind="job", status="running") == 0
    assert value(after, "shardyard_selections", status="succeeded") == 1
    assert value(after, "shardyard_trials", status="succeeded") == 2
    # the API's latency histogram, by route template, moved with this test's requests
    route = {"method": "GET", "route": "/api/jobs/{job_id}", "status": "200"}
    count = "shardyard_http_request_duration_seconds_count"
    assert value(after, count, **route) > value(before, count, **route) + 1
    assert not any("/api/jobs/" + str(job["id"]) in dict(ls).get("route", "") for (_n, ls) in after)
    # the scheduler ticks in a child process: its values reach /metrics through the shared folder
    assert value(after, "shardyard_scheduler_tick_seconds_count") > value(
        before, "shardyard_scheduler_tick_seconds_count"
    )
    assert value(after, "shardyard_scheduler_decision_seconds_count") > 0
    assert value(after, "shardyard_scheduler_placements_total") >= 2


def test_a_user_gets_one_signed_delivery_per_ended_job_and_batch(ops: StackHandle) -> None:
    flaky, stuck = Receiver(fail_first=2), Receiver(hang=True)
    try:
        with user_client(ops, "hooked") as c:
            made = c.post("/api/webhooks", json={"url": flaky.url, "events": "all"})
            assert made.status_code == 201, made.text
            hook, secret = made.json()["webhook"], made.json()["secret"]
            assert c.post("/api/webhooks", json={"url": stuck.url}).status_code == 201
            bad = c.post("/api/webhooks", json={"url": "file:///etc/passwd"})
            assert bad.status_code == 422 and "url" in bad.json()["detail"]

            job = c.post("/api/jobs", json={**TINY_SPEC, "name": "told"})
            assert job.status_code == 201, job.text
            jid = job.json()["id"]
            sel = c.post("/api/selections", json=BATCH)
            assert sel.status_code == 201, sel.text
            sid = sel.json()["id"]
            ops.wait(jid, ("succeeded",), timeout=240)

            def delivered() -> list[dict]:
                got = [json.loads(r.body) for r in flaky.answered_ok()]
                return got if {g["event"] for g in got} == {"job.ended", "selection.ended"} else []

            wait_for("both ends delivered to the receiver that failed twice first", delivered)
            time.sleep(2)  # past several backoffs: nothing more arrives
            got = [json.loads(r.body) for r in flaky.answered_ok()]
            assert sorted((g["event"], g.get("job", g.get("selection"))["id"]) for g in got) == [
                ("job.ended", jid),
                ("selection.ended", sid),
            ], "one delivery per ended job or batch; the batch's trials are not told one by one"
            for r in flaky.requests:
                assert verify(secret, header=r.headers["Shardyard-Signature"], body=r.body)
            # the hanging receiver holds its POSTs, and nobody waited for it
            wait_for("the hanging receiver to be called", stuck.arrived.is_set)
            assert all(r.answered == 0 for r in stuck.requests)

            # the receiver has answered; the deliverer records that just after
            def settled() -> list[dict] | None:
                items = c.get(f"/api/webhooks/{hook['id']}/deliveries").json()["items"]
                return items if [d["state"] for d in items] == ["delivered", "delivered"] else None

            log = wait_for("the delivery log to show both delivered", settled)
            codes = sorted(a["status_code"] for d in log for a in d["attempts"])
            assert codes == [200, 200, 500, 500]
            assert {(d["event"], d["object_id"], d["status"]) for d in log} == {
                ("job.ended", jid, "succeeded"),
                ("selection.ended", sid, "succeeded"),
            }
            # another user neither sees nor deletes it
            with user_client(ops, "someone-else") as other:
                assert other.get(f"/api/webhooks/{hook['id']}/deliveries").status_code == 404
                assert other.delete(f"/api/webhooks/{hook['id']}").status_code == 404
            assert c.delete(f"/api/webhooks/{hook['id']}").status_code == 200
            assert hook["id"] not in [h["id"] for h in c.get("/api/webhooks").json()["items"]]
    finally:
        flaky.close()
        stuck.close()
