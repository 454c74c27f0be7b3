"""Webhooks against a real database (SQLite and PostgreSQL, migrated by Alembic) and real HTTP
receivers on loopback: the outbox rows the end-of-job triggers write, signing, retries with
backoff, and a receiver that hangs."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator

import pytest

from core.egress import EgressAllow
from core.settings import Settings
from core.webhooks import Deliverer, UnsafeUrl, check_url, sign, verify
from db import jobs as dbj
from db import selections as dbsel
from db import users as dbu
from db import webhooks as dbw
from db.connection import session_for
from db.models import WebhookDelivery
from tests.webhook_receiver import Receiver


def _user(url: str, name: str = "ann") -> int:
    with session_for(url) as s:
        return dbu.create_user(s, name=name).id


def _hook(url: str, *, user_id: int, target: str, events: str = "all", secret: str = "s3cret") -> int:
    with session_for(url) as s:
        return dbw.create_webhook(s, user_id=user_id, url=target, events=events, secret=secret).id


def _job(url: str, *, owner_id: int, kind: str = "job") -> int:
    with session_for(url) as s:
        return dbj.create_job(s, name="j", spec={}, steps=3, owner_id=owner_id, kind=kind).id


def _outbox(url: str) -> list[tuple[int, str, int, str]]:
    with session_for(url) as s:
        rows = s.query(WebhookDelivery).order_by(WebhookDelivery.id).all()
        return [(r.webhook_id, r.event, r.object_id, r.status) for r in rows]


def test_every_end_of_a_job_or_batch_queues_one_delivery_per_matching_webhook(db_url: str) -> None:
    ann, bob = _user(db_url), _user(db_url, "bob")
    every = _hook(db_url, user_id=ann, target="http://h.invalid/a")
    failures = _hook(db_url, user_id=ann, target="http://h.invalid/f", events="failures")
    done, failed, cancelled = (_job(db_url, owner_id=ann) for _ in range(3))
    bobs, trial = _job(db_url, owner_id=bob), _job(db_url, owner_id=ann, kind="trial")
    with session_for(db_url) as s:
        attempt = dbj.claim_job(s, job_id=done, owner="w", worker="w", lease_s=30)
        assert attempt is not None
        assert dbj.finish_job(s, attempt=attempt, status=dbj.JobStatus.succeeded) is not None
        # a second finish of the same attempt is fenced off: no second end, no second delivery
        assert dbj.finish_job(s, attempt=attempt, status=dbj.JobStatus.failed) is None
        dbj.fail_job(s, job_id=failed, reason="operator")
        dbj.request_cancel(s, job_id=cancelled)
        dbj.fail_job(s, job_id=bobs, reason="not ann's")
        dbj.fail_job(s, job_id=trial, reason="a trial is told through its batch")
    assert _outbox(db_url) == [
        (every, "job.ended", done, "succeeded"),
        (every, "job.ended", failed, "failed"),
        (failures, "job.ended", failed, "failed"),
        (every, "job.ended", cancelled, "cancelled"),
    ]
    # an end that is rolled back leaves no delivery behind: the row is in the same transaction
    with session_for(db_url) as s:
        job = dbj.get_job(s, dbj.requeue_job(s, job_id=failed, reason="again").id)
        assert job.status == "queued"
        job.status = "failed"
        s.flush()
        s.rollback()
    assert len(_outbox(db_url)) == 4
    with session_for(db_url) as s:  # ended again after a requeue: told again
        dbj.fail_job(s, job_id=failed, reason="twice")
        sel = dbsel.create_selection(
            s, name="b", request={}, metric="loss", mode="min", scheduler="x", owner_id=ann
        )
        dbsel.cancel_selection(s, selection_id=sel.id)
    assert _outbox(db_url)[4:] == [
        (every, "job.ended", failed, "failed"),
        (failures, "job.ended", failed, "failed"),
        (every, "selection.ended", sel.id, "cancelled"),
    ]


def _settings(url: str, **over: object) -> Settings:
    # the receivers listen on loopback: the operator's allow-list names it
    base = {"webhook_backoff_s": 0.05, "webhook_allow": ["127.0.0.1/32"], "webhook_timeout_s": 5.0}
    return Settings(database_url=url, **{**base, **over})


def _deliver_until(deliverer: Deliverer, done, timeout_s: float = 60) -> None:  # noqa: ANN001
    deadline = time.monotonic() + timeout_s
    while not done():
        assert time.monotonic() < deadline, "deliveries did not settle"
        deliverer.poll()
        time.sleep(0.05)


@pytest.fixture
def receivers() -> Iterator[list[Receiver]]:
    made: list[Receiver] = []
    yield made
    for r in made:
        r.close()


def test_a_receiver_that_fails_twice_gets_exactly_one_signed_delivery(db_url: str, receivers: list) -> None:
    rx = Receiver(fail_first=2)
    receivers.append(rx)
    ann = _user(db_url)
    hook = _hook(db_url, user_id=ann, target=rx.url, secret="whsec_test")
    job = _job(db_url, owner_id=ann)
    with session_for(db_url) as s:
        dbj.fail_job(s, job_id=job, reason="boom")
    deliverer = Deliverer(_settings(db_url))

    def delivered() -> bool:
        with session_for(db_url) as s:
            return dbw.deliveries(s, webhook_id=hook, limit=1)[0][0].state == "delivered"

    try:
        _deliver_until(deliverer, delivered)
        for _ in range(20):  # settled: more polls send nothing more
            deliverer.poll()
            time.sleep(0.05)
    finally:
        deliverer.stop()
    assert [r.answered for r in rx.requests] == [500, 500, 200]
    bodies = {r.body for r in rx.requests}
    assert len(bodies) == 1, "every retry carries the same bytes"
    assert len({r.headers["Shardyard-Delivery"] for r in rx.requests}) == 1
    for r in rx.requests:
        assert verify("whsec_test", header=r.headers["Shardyard-Signature"], body=r.body)
        assert not verify("another", header=r.headers["Shardyard-Signature"], body=r.body)
    payload = json.loads(bodies.pop())
    assert payload["event"] == "job.ended"
    assert payload["job"]["id"] == job and payload["job"]["status"] == "failed"
    assert payload["job"]["error"] == "boom"
    with session_for(db_url) as s:
        [(delivery, attempts)] = dbw.deliveries(s, webhook_id=hook, limit=10)
    assert delivery.state == "delivered" and delivery.attempts == 3
    assert [a.status_code for a in attempts] == [500, 500, 200]
    assert attempts[0].error == "answered 500" and attempts[2].error is None


def test_a_receiver_that_never_answers_delays_no_other(db_url: str, receivers: list) -> None:
    stuck, fine = Receiver(hang=True), Receiver()
    receivers.extend([stuck, fine])
    ann = _user(db_url)
    _hook(db_url, user_id=ann, target=stuck.url)
    good = _hook(db_url, user_id=ann, target=fine.url)
    jobs = [_job(db_url, owner_id=ann) for _ in range(3)]
    with session_for(db_url) as s:
        for j in jobs:
            dbj.fail_job(s, job_id=j, reason="x")
    # the stuck receiver would hold a POST far longer than this test waits for the others
    deliverer = Deliverer(_settings(db_url, webhook_timeout_s=600.0, webhook_concurrency=4))

    def states() -> list[str]:
        with session_for(db_url) as s:
            return [d.state for d, _ in dbw.deliveries(s, webhook_id=good, limit=10)]

    try:
        # the stuck receiver's three POSTs hold three of the four threads; the fourth serves the rest
        _deliver_until(deliverer, lambda: stuck.arrived.is_set() and states() == ["delivered"] * 3)
        assert len(fine.answered_ok()) == 3
        assert stuck.requests and all(r.answered == 0 for r in stuck.requests)
    finally:
        deliverer.stop()


def test_giving_up_after_the_last_attempt_is_logged(db_url: str) -> None:
    ann = _user(db_url)
    # nothing listens on this port: each attempt is a connection error
    hook = _hook(db_url, user_id=ann, target="http://127.0.0.1:9/hook")
    with session_for(db_url) as s:
        dbj.fail_job(s, job_id=_job(db_url, owner_id=ann), reason="x")
    deliverer = Deliverer(_settings(db_url, webhook_attempts=3))
    try:

        def settled() -> bool:
            with session_for(db_url) as s:
                return dbw.deliveries(s, webhook_id=hook, limit=1)[0][0].state != "pending"

        _deliver_until(deliverer, settled)
    finally:
        deliverer.stop()
    with session_for(db_url) as s:
        [(delivery, attempts)] = dbw.deliveries(s, webhook_id=hook, limit=1)
    assert delivery.state == "failed" and len(attempts) == 3
    assert all(a.status_code is None and "Connect" in (a.error or "") for a in attempts)


def test_signatures_outside_the_replay_window_or_over_other_bytes_fail() -> None:
    body = '{"event":"job.ended"}'
    header = sign("k", timestamp=1_000_000, body=body)
    assert verify("k", header=header, body=body, now=1_000_100)
    assert not verify("k", header=header, body=body, now=1_000_000 + 301)
    assert not verify("k", header=header, body=body + " ", now=1_000_100)
    assert not verify("k", header="t=1000000", body=body, now=1_000_100)


@pytest.mark.parametrize(
    ("url", "rule"),
    [
        ("ftp://example.com/x", "scheme must be http or https"),
        ("http:///nohost", "no host"),
        ("http://u:p@example.com/", "user name or password"),
        ("http://127.0.0.1:8000/h", "non-public address"),
        ("http://localhost/h", "non-public address"),
        ("https://10.1.2.3/h", "non-public address"),
        ("http://169.254.169.254/latest/meta-data", "non-public address"),
        ("http://[::1]/h", "non-public address"),
        ("http://[::1/h", "cannot be parsed"),
        ("http://example.com/a b", "spaces or control characters"),
    ],
)
def test_webhook_urls_that_are_refused(url: str, rule: str) -> None:
    with pytest.raises(UnsafeUrl, match=rule):
        check_url(url, allow=EgressAllow())


def test_private_hosts_are_allowed_only_when_the_setting_says_so() -> None:
    check_url("http://127.0.0.1:8000/h", allow=EgressAllow.parse(["127.0.0.1/32"]))
    check_url("https://93.184.215.14/h", allow=EgressAllow())
