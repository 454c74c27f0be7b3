"""Users, tokens, ownership and the dashboard's cookie session, over real HTTP against the stack
(uvicorn, redis-server, a Celery worker)."""

from __future__ import annotations

import secrets
import threading
import time
from collections.abc import Iterator
from contextlib import closing
from datetime import timedelta
from typing import Any

import httpx
import pytest
from sqlalchemy import update

from db.connection import session_for
from db.jobs import JobStatus, aware, claim_job, create_job, finish_job
from db.models import ApiToken, utcnow
from tests.conftest import TINY_SPEC, StackHandle
from tests.sse import sse_frames

pytestmark = pytest.mark.integration

# a job that trains in a few seconds; these tests check who may see and touch it
SHORT = {**TINY_SPEC, "train": {**TINY_SPEC["train"], "steps": 3, "eval_every": 3}}


def new_user(stack: StackHandle, **fields: Any) -> tuple[dict, httpx.Client]:
    name = f"u{secrets.token_hex(4)}"
    resp = stack.client.post("/api/users", json={"name": name, **fields})
    assert resp.status_code == 201, resp.text
    body = resp.json()
    client = httpx.Client(
        base_url=stack.base_url, timeout=30, headers={"Authorization": f"Bearer {body['token']}"}
    )
    return body, client


def test_two_users_see_and_touch_only_their_own_jobs(stack: StackHandle) -> None:
    a, ca = new_user(stack)
    b, cb = new_user(stack)
    with ca, cb:
        job = ca.post("/api/jobs", json={**SHORT, "name": "alices"}).json()
        assert job["owner"] == a["user"]["name"]
        # B sees nothing of A's: not in the list, not by id, not its stream, metrics or logs
        assert all(j["id"] != job["id"] for j in cb.get("/api/jobs").json()["items"])
        for path in ("", "/metrics", "/logs", "/stream"):
            assert cb.get(f"/api/jobs/{job['id']}{path}").status_code == 404, path
        # and cannot cancel it: it reads as absent
        resp = cb.post(f"/api/jobs/{job['id']}/cancel")
        assert resp.status_code == 404 and "does not exist" in resp.json()["detail"]
        mine = ca.get("/api/jobs").json()
        assert [j["id"] for j in mine["items"]] == [job["id"]] and mine["total"] == 1
        # the admin sees everyone's, with the owner, and filters by owner and name
        by_owner = stack.client.get("/api/jobs", params={"owner": a["user"]["name"]}).json()
        assert [j["id"] for j in by_owner["items"]] == [job["id"]]
        by_name = stack.client.get("/api/jobs", params={"name": "ALICE", "owner": a["user"]["name"]}).json()
        assert by_name["total"] == 1
        assert stack.client.get("/api/jobs", params={"name": "no-such-name-xyz"}).json()["total"] == 0
        # the admin acts on it, and the event says who did
        stack.wait(job["id"], ("succeeded",), timeout=180)
        logs = ca.get(f"/api/jobs/{job['id']}/logs").json()["items"]
        assert logs[0]["data"] == {"by": a["user"]["name"]}


def test_admin_cancel_is_recorded_with_the_acting_user(stack: StackHandle) -> None:
    a, ca = new_user(stack, max_running_jobs=0)  # its jobs could never start...
    with ca:
        resp = ca.post("/api/jobs", json=SHORT)
        assert resp.status_code == 422 and "may run no jobs" in resp.json()["detail"]
    a, ca = new_user(stack)
    with ca:
        job = ca.post("/api/jobs", json={**SHORT, "train": {**SHORT["train"], "steps": 100000}}).json()
        resp = stack.client.post(f"/api/jobs/{job['id']}/cancel")
        assert resp.status_code == 200
        stack.wait(job["id"], ("cancelled",), timeout=60)
        events = ca.get(f"/api/jobs/{job['id']}/logs").json()["items"]
        assert any((e["data"] or {}).get("by") == "admin" for e in events[1:]), events


def test_revoked_token_is_refused_and_tokens_are_shown_once(stack: StackHandle) -> None:
    a, ca = new_user(stack)
    with ca:
        uid = a["user"]["id"]
        second = ca.post(f"/api/users/{uid}/tokens", json={"label": "laptop"}).json()
        listed = ca.get("/api/tokens").json()["items"]
        assert {t["label"] for t in listed} == {"first", "laptop"}
        assert all("token" not in t and second["token"] not in str(t) for t in listed)
        assert ca.delete(f"/api/tokens/{second['info']['id']}").status_code == 200
        gone = httpx.get(f"{stack.base_url}/api/jobs", headers={"Authorization": f"Bearer {second['token']}"})
        assert gone.status_code == 401 and "revoked" in gone.json()["detail"]
        assert gone.headers["www-authenticate"] == "Bearer"
        assert ca.get("/api/jobs").status_code == 200  # the other token still works
        # no token, a malformed header, a made-up token
        assert httpx.get(f"{stack.base_url}/api/jobs").status_code == 401
        assert (
            httpx.get(f"{stack.base_url}/api/jobs", headers={"Authorization": "Basic eDp5"}).status_code
            == 401
        )
        assert (
            httpx.get(f"{stack.base_url}/api/jobs", headers={"Authorization": "Bearer sy_nope"}).status_code
            == 401
        )
        # a user cannot make users, nor list or revoke others' tokens
        assert ca.post("/api/users", json={"name": "mallory"}).status_code == 403
        admin_tokens = [t for t in stack.client.get("/api/tokens").json()["items"] if t["user"] == "admin"]
        assert ca.delete(f"/api/tokens/{admin_tokens[0]['id']}").status_code == 404


def test_cookie_session_needs_csrf_and_same_origin(stack: StackHandle) -> None:
    a, ca = new_user(stack)
    with ca, httpx.Client(base_url=stack.base_url, timeout=30) as browser:
        resp = browser.post("/api/auth/session", json={"token": a["token"]})
        assert resp.status_code == 200, resp.text
        csrf = resp.json()["csrf_token"]
        assert "httponly" in resp.headers.get_list("set-cookie")[0].lower()
        assert browser.get("/api/auth/me").json()["user"]["name"] == a["user"]["name"]
        job = browser.post("/api/jobs", json=SHORT, headers={"X-CSRF-Token": csrf}).json()
        assert job["owner"] == a["user"]["name"]
        # another site's page posting with the browser's cookie: no CSRF token -> 403
        evil = {"Origin": "http://evil.example"}
        resp = browser.post(f"/api/jobs/{job['id']}/cancel", headers=evil)
        assert resp.status_code == 403
        # even with a token it cannot know, the foreign Origin alone is refused
        resp = browser.post(f"/api/jobs/{job['id']}/cancel", headers={**evil, "X-CSRF-Token": csrf})
        assert resp.status_code == 403 and "Origin" in resp.json()["detail"]
        # a plain HTML form (text/plain, form-encoded) is refused before any route
        for ctype in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x"):
            resp = browser.post(
                f"/api/jobs/{job['id']}/cancel", content=b"a=b", headers={"Content-Type": ctype}
            )
            assert resp.status_code == 415, ctype
        assert stack.job(job["id"])["cancel_requested"] is False
        # the dashboard's own request: same origin, CSRF header
        same = {"Origin": stack.base_url, "X-CSRF-Token": csrf}
        assert browser.post(f"/api/jobs/{job['id']}/cancel", headers=same).status_code == 200
        # the SSE stream works on the cookie alone (EventSource sends no headers)
        with browser.stream("GET", f"/api/jobs/{job['id']}/stream") as r:
            assert r.status_code == 200
            assert any(line.startswith("event: status") for line in r.iter_lines())
        # sign out ends the session
        assert browser.delete("/api/auth/session", headers=same).status_code == 204
        assert browser.get("/api/auth/me").status_code == 401


def test_workspaces_belong_to_their_uploader(stack: StackHandle) -> None:
    from tests.archives import targz

    a, ca = new_user(stack)
    b, cb = new_user(stack)
    body = targz({"notes.txt": secrets.token_hex(16).encode()})  # unique bytes: a fresh row
    gz = {"content-type": "application/gzip"}
    with ca, cb:
        ws = ca.post("/api/workspaces", content=body, headers=gz)
        assert ws.status_code == 201, ws.text
        ws = ws.json()
        assert ws["owner_id"] == a["user"]["id"]
        # B: not in the list, absent by id and digest, not usable in a job, not deletable
        assert all(w["id"] != ws["id"] for w in cb.get("/api/workspaces").json()["items"])
        assert cb.get(f"/api/workspaces/{ws['id']}").status_code == 404
        assert cb.get(f"/api/workspaces/{ws['ref']}").status_code == 404
        resp = cb.post("/api/jobs", json={**SHORT, "workspace": ws["ref"]})
        assert resp.status_code == 422 and "not found" in resp.json()["detail"]
        assert cb.delete(f"/api/workspaces/{ws['id']}").status_code == 404
        # the same bytes uploaded by B are B's own workspace, not A's
        mine = cb.post("/api/workspaces", content=body, headers=gz)
        assert mine.status_code == 201, mine.text
        assert mine.json()["id"] != ws["id"] and mine.json()["owner_id"] == b["user"]["id"]
        # A and the admin see it
        assert ca.get(f"/api/workspaces/{ws['ref']}").status_code == 200
        assert stack.client.get(f"/api/workspaces/{ws['id']}").status_code == 200
        # an archive over the body limit of JSON requests is fine here (its own limit applies)
        big = targz({"data.bin": secrets.token_bytes(2 * 2**20)})
        assert ca.post("/api/workspaces", content=big, headers=gz).status_code == 201


def test_operator_actions_are_for_admins_and_record_who(stack: StackHandle) -> None:
    a, ca = new_user(stack)
    with ca:
        job = ca.post("/api/jobs", json={**SHORT, "train": {**SHORT["train"], "steps": 100000}}).json()
        for path in (f"/api/jobs/{job['id']}/fail", f"/api/jobs/{job['id']}/requeue"):
            assert ca.post(path, json={"reason": "mine"}).status_code == 403, path
        assert ca.delete(f"/api/jobs/{job['id']}").status_code == 403
        resp = stack.client.post(f"/api/jobs/{job['id']}/fail", json={"reason": "stuck"})
        assert resp.status_code == 200 and resp.json()["status"] == "failed"
        events = ca.get(f"/api/jobs/{job['id']}/logs").json()["items"]
        assert {"error": "stuck", "by": "admin"} in [e["data"] for e in events]
        assert stack.client.delete(f"/api/jobs/{job['id']}").status_code == 204
        assert ca.get(f"/api/jobs/{job['id']}").status_code == 404


class _Events:
    """A live /api/events stream read in a thread: its frames in order, and when it was open."""

    def __init__(self, base_url: str, token: str) -> None:
        self.frames: list[tuple[str, dict]] = []
        self.open = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._read, args=(base_url, token), daemon=True)
        self._thread.start()
        assert self.open.wait(30), "the events stream did not open"

    def _read(self, base_url: str, token: str) -> None:
        headers = {"Authorization": f"Bearer {token}"}
        with httpx.stream("GET", f"{base_url}/api/events", headers=headers, timeout=60) as r:
            for _, event, data in sse_frames(self._lines(r)):
                self.frames.append((event, data))

    def _lines(self, r: httpx.Response) -> Iterator[str]:
        for line in r.iter_lines():
            self.open.set()  # the first line comes after the stream subscribed
            if self._stop.is_set():
                return
            yield line

    def wait_for(self, predicate, timeout: float = 60) -> None:  # noqa: ANN001
        deadline = time.monotonic() + timeout
        while not any(predicate(ev, data) for ev, data in list(self.frames)):
            assert time.monotonic() < deadline, f"not seen in {self.frames}"
            time.sleep(0.1)

    def close(self) -> None:
        self._stop.set()


def test_deleted_frames_reach_only_the_owner_and_admins(stack: StackHandle) -> None:
    a, ca = new_user(stack)
    b, cb = new_user(stack)
    with ca, cb:
        # A's finished job, written straight into the database (no training needed to delete one)
        with session_for(stack.stack.database_url) as s:
            job_id = create_job(s, name="to-delete", spec=SHORT, owner_id=a["user"]["id"]).id
            attempt = claim_job(s, job_id=job_id, owner="test", worker="test", lease_s=60)
            assert attempt is not None and finish_job(s, attempt=attempt, status=JobStatus.succeeded)
        job = ca.get(f"/api/jobs/{job_id}").json()
        streams = {
            who: _Events(stack.base_url, tok)
            for who, tok in (("a", a["token"]), ("b", b["token"]), ("admin", stack.token))
        }
        try:
            assert stack.client.delete(f"/api/jobs/{job['id']}").status_code == 204
            gone = lambda ev, d: ev == "deleted" and d == {"job_id": job["id"]}  # noqa: E731
            streams["a"].wait_for(gone)
            streams["admin"].wait_for(gone)
            # B's stream is live (it shows B's own new job, announced after the delete) and
            # never carried the other user's deletion
            mine = cb.post("/api/jobs", json={**SHORT, "name": "bobs"}).json()
            streams["b"].wait_for(lambda ev, d: ev == "job" and d.get("id") == mine["id"])
            assert not any(ev == "deleted" for ev, _ in streams["b"].frames), streams["b"].frames
            assert cb.post(f"/api/jobs/{mine['id']}/cancel").status_code == 200
        finally:
            for st in streams.values():
                st.close()


def sign_in(stack: StackHandle, token: str) -> tuple[httpx.Client, dict[str, str]]:
    """A browser-like client holding a dashboard session made from `token`, and the headers its
    POSTs and DELETEs send (same origin, CSRF token)."""
    browser = httpx.Client(base_url=stack.base_url, timeout=30)
    resp = browser.post("/api/auth/session", json={"token": token})
    assert resp.status_code == 200, resp.text
    return browser, {"Origin": stack.base_url, "X-CSRF-Token": resp.json()["csrf_token"]}


class _Stream:
    """Any SSE stream read in a thread, with a session cookie or a Bearer token: its frames, and
    whether the server has closed it."""

    def __init__(self, client: httpx.Client, path: str) -> None:
        self.frames: list[tuple[str, dict]] = []
        self.closed = threading.Event()
        self.opened = threading.Event()
        self._thread = threading.Thread(target=self._read, args=(client, path), daemon=True)
        self._thread.start()
        assert self.opened.wait(30), f"{path} did not open"

    def _read(self, client: httpx.Client, path: str) -> None:
        try:
            with client.stream("GET", path, timeout=httpx.Timeout(30, read=120)) as r:
                assert r.status_code == 200, r.read()
                for _, event, data in sse_frames(self._lines(r)):
                    self.frames.append((event, data))
        finally:
            self.closed.set()

    def _lines(self, r: httpx.Response) -> Iterator[str]:
        for line in r.iter_lines():
            self.opened.set()  # the first line (retry:) comes once the stream is subscribed
            yield line


def test_revoking_a_token_ends_its_sessions_and_open_streams(stack: StackHandle) -> None:
    a, ca = new_user(stack)
    browser, same = sign_in(stack, a["token"])
    with ca, closing(browser):
        first_id = next(t["id"] for t in ca.get("/api/tokens").json()["items"] if t["kind"] == "api")
        # the session is listed beside its token, made from it, and the admin sees it too
        sessions = [t for t in ca.get("/api/tokens").json()["items"] if t["kind"] == "session"]
        assert len(sessions) == 1 and sessions[0]["parent_id"] == first_id, sessions
        assert sessions[0]["expires_at"] is not None
        assert any(t["id"] == sessions[0]["id"] for t in stack.client.get("/api/tokens").json()["items"])
        # a job that outlasts the test: its stream must end for the revocation, not the job's end
        endless = {**SHORT, "name": "watched", "train": {**SHORT["train"], "steps": 100000}}
        job = browser.post("/api/jobs", json=endless, headers=same).json()
        # streams opened with the session and with the token itself, both quiet and open
        by_cookie = _Stream(browser, "/api/events")
        by_token = _Stream(ca, f"/api/jobs/{job['id']}/stream")
        by_cookie_job = _Stream(browser, f"/api/jobs/{job['id']}/stream")
        assert browser.get("/api/jobs").status_code == 200

        assert stack.client.delete(f"/api/tokens/{first_id}").status_code == 200
        # one DELETE: the token, its session, and every stream opened with either
        assert ca.get("/api/jobs").status_code == 401
        resp = browser.get("/api/jobs")
        assert resp.status_code == 401 and "revoked" in resp.json()["detail"], resp.text
        for st in (by_cookie, by_token, by_cookie_job):
            assert st.closed.wait(60), "a stream outlived its revoked credential"
            event, data = st.frames[-1]
            assert event == "error" and data["status"] == 401 and "revoked" in data["detail"], st.frames
        # and the session cannot be used to mint its way back in
        resp = browser.post(f"/api/users/{a['user']['id']}/tokens", json={"label": "back"}, headers=same)
        assert resp.status_code == 401
        assert stack.client.post(f"/api/jobs/{job['id']}/cancel").status_code == 200


def test_sessions_are_ended_one_by_one_or_all_at_once(stack: StackHandle) -> None:
    a, ca = new_user(stack)
    one, same1 = sign_in(stack, a["token"])
    two, _ = sign_in(stack, a["token"])
    with ca, closing(one), closing(two):
        ids = [t["id"] for t in ca.get("/api/tokens").json()["items"] if t["kind"] == "session"]
        assert len(ids) == 2
        # an admin ends the first session; the second and the token go on
        ended = stack.client.delete(f"/api/tokens/{ids[0]}")
        assert ended.status_code == 200 and ended.json()["revoked_at"] is not None
        assert one.get("/api/jobs").status_code == 401
        assert two.get("/api/jobs").status_code == 200 and ca.get("/api/jobs").status_code == 200
        # an ended session is no longer listed
        assert [t["id"] for t in ca.get("/api/tokens").json()["items"] if t["kind"] == "session"] == ids[1:]
        # another user can neither see nor end them
        b, cb = new_user(stack)
        with cb:
            assert cb.delete(f"/api/tokens/{ids[1]}").status_code == 404
            assert cb.delete(f"/api/users/{a['user']['id']}/tokens").status_code == 404
        # revoking the user: every token and session at once
        resp = stack.client.delete(f"/api/users/{a['user']['id']}/tokens")
        assert resp.status_code == 200 and resp.json()["revoked"] == 2  # the token, the session
        assert two.get("/api/jobs").status_code == 401 and ca.get("/api/jobs").status_code == 401


def test_a_session_cannot_mint_a_token_without_presenting_one(stack: StackHandle) -> None:
    a, ca = new_user(stack)
    b, cb = new_user(stack)
    browser, same = sign_in(stack, a["token"])
    uid = a["user"]["id"]
    with ca, cb, closing(browser):
        resp = browser.post(f"/api/users/{uid}/tokens", json={"label": "stolen"}, headers=same)
        assert resp.status_code == 403 and "confirm_token" in resp.json()["detail"], resp.text
        # another user's token does not confirm
        resp = browser.post(
            f"/api/users/{uid}/tokens", json={"label": "x", "confirm_token": b["token"]}, headers=same
        )
        assert resp.status_code == 403
        assert {t["label"] for t in ca.get("/api/tokens").json()["items"]} == {"first", "dashboard"}
        # with one of the user's own tokens it may; the new token is made from that one
        resp = browser.post(
            f"/api/users/{uid}/tokens", json={"label": "laptop", "confirm_token": a["token"]}, headers=same
        )
        assert resp.status_code == 201, resp.text
        minted = resp.json()
        # a token minted with a Bearer token is made from it as well
        by_bearer = ca.post(f"/api/users/{uid}/tokens", json={"label": "ci"}).json()
        first_id = by_bearer["info"]["parent_id"]
        assert minted["info"]["parent_id"] == first_id is not None
        # so revoking the first token cuts off everything that came from it
        assert stack.client.delete(f"/api/tokens/{first_id}").status_code == 200
        for secret in (minted["token"], by_bearer["token"]):
            resp = httpx.get(f"{stack.base_url}/api/jobs", headers={"Authorization": f"Bearer {secret}"})
            assert resp.status_code == 401
        # an admin's token for another user is that user's own: B's stays when the admin's goes
        resp = stack.client.post(f"/api/users/{b['user']['id']}/tokens", json={"label": "given"})
        assert resp.status_code == 201 and resp.json()["info"]["parent_id"] is None


def test_an_idle_session_ends(stack: StackHandle) -> None:
    """SHARDYARD_SESSION_IDLE_S (2 h): a session last used longer ago answers 401 saying so; its
    use is recorded, so a session in use does not end."""
    a, ca = new_user(stack)
    browser, _ = sign_in(stack, a["token"])
    with ca, closing(browser):
        assert browser.get("/api/jobs").status_code == 200
        sid = next(t["id"] for t in ca.get("/api/tokens").json()["items"] if t["kind"] == "session")
        with session_for(stack.stack.database_url) as s:
            s.execute(
                update(ApiToken).where(ApiToken.id == sid).values(last_used_at=utcnow() - timedelta(hours=1))
            )
            s.commit()
        assert browser.get("/api/jobs").status_code == 200  # an hour idle: still on, and used now
        with session_for(stack.stack.database_url) as s:
            assert aware(s.get(ApiToken, sid).last_used_at) > utcnow() - timedelta(minutes=5)
            s.execute(
                update(ApiToken).where(ApiToken.id == sid).values(last_used_at=utcnow() - timedelta(hours=3))
            )
            s.commit()
        resp = browser.get("/api/jobs")
        assert resp.status_code == 401 and "idle" in resp.json()["detail"], resp.text
        assert ca.get("/api/jobs").status_code == 200  # the token itself has no idle limit
