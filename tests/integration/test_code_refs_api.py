"""Every code reference a request makes is authorised, over real HTTP against the stack: a
selection batch may name only its owner's workspace (in its base; its space may not name one at
all), its trials are pinned to the workspace's digest as a job is, and a job row written past the
API with another user's digest fails on the worker with the reason."""

from __future__ import annotations

import secrets
from typing import Any

import httpx
import pytest

from db import jobs as db_jobs
from db.connection import session_for
from jobrules.spec import JobSpec
from tests.archives import targz
from tests.conftest import TINY_SPEC, StackHandle

pytestmark = pytest.mark.integration

SHORT = {**TINY_SPEC, "train": {**TINY_SPEC["train"], "steps": 3, "eval_every": 3}}
GZ = {"content-type": "application/gzip"}


def _user(stack: StackHandle) -> tuple[dict[str, Any], httpx.Client]:
    resp = stack.client.post("/api/users", json={"name": f"r{secrets.token_hex(4)}"})
    assert resp.status_code == 201, resp.text
    body = resp.json()
    headers = {"Authorization": f"Bearer {body['token']}"}
    return body, httpx.Client(base_url=stack.base_url, timeout=30, headers=headers)


def _workspace(client: httpx.Client) -> dict[str, Any]:
    resp = client.post("/api/workspaces", content=targz({"notes.txt": secrets.token_bytes(16)}), headers=GZ)
    assert resp.status_code == 201, resp.text
    return resp.json()


def _batch(base: dict[str, Any], space: dict[str, Any] | None = None, **over: Any) -> dict[str, Any]:
    return {
        "name": "refs",
        "base": base,
        "space": space or {"train.lr": [1e-3, 2e-3]},
        "method": "grid",
        **over,
    }


def test_a_selection_may_not_name_another_users_workspace(stack: StackHandle) -> None:
    _a, ca = _user(stack)
    _b, cb = _user(stack)
    with ca, cb:
        ws = _workspace(ca)
        for ref in (str(ws["id"]), ws["ref"]):
            # in the base: the batch's owner has no such workspace
            resp = cb.post("/api/selections", json=_batch({**SHORT, "workspace": ref}))
            assert resp.status_code == 422, resp.text
            detail = resp.json()["detail"]
            assert "base.workspace" in detail and "not found" in detail, detail
            # in the space: a workspace is never a searched value, whoever's it is
            resp = cb.post("/api/selections", json=_batch(SHORT, {"workspace": [ref]}))
            assert resp.status_code == 422, resp.text
            detail = resp.json()["detail"]
            assert "space" in detail and "may not be searched" in detail, detail
            # nor by its owner, with a sampler method
            resp = ca.post(
                "/api/selections", json=_batch(SHORT, {"workspace": [ref]}, method="tpe", trials=2)
            )
            assert resp.status_code == 422 and "may not be searched" in resp.json()["detail"], resp.text
        resp = cb.post("/api/selections", json=_batch(SHORT, {"env.pip": [["einops"], ["timm"]]}))
        assert resp.status_code == 422 and "'env.pip' may not be searched" in resp.json()["detail"], resp.text
        # an admin's batch and job run the admin's own workspaces: another user's is refused too
        for path, body in (
            ("/api/selections", _batch({**SHORT, "workspace": str(ws["id"])})),
            ("/api/jobs", {**SHORT, "workspace": str(ws["id"])}),
        ):
            resp = stack.client.post(path, json=body)
            assert resp.status_code == 422 and "not found" in resp.json()["detail"], resp.text
        # nothing was stored for any of them
        names = [s["name"] for s in cb.get("/api/selections").json()["items"]]
        assert "refs" not in names


def test_trials_and_the_stored_base_are_pinned_to_the_digest(stack: StackHandle) -> None:
    _a, ca = _user(stack)
    with ca:
        ws = _workspace(ca)
        resp = ca.post(
            "/api/selections", json=_batch({**SHORT, "workspace": str(ws["id"])}, method="random", trials=1)
        )
        assert resp.status_code == 201, resp.text
        sel = resp.json()
        try:
            # the stored request, which added trials and a sampler's later trials are made from
            assert sel["request"]["base"]["workspace"] == ws["ref"]
            added = ca.post(f"/api/selections/{sel['id']}/trials", json={"params": [{"train.lr": 5e-3}]})
            assert added.status_code == 201, added.text
            trials = ca.get(f"/api/selections/{sel['id']}").json()["trials"]
            assert len(trials) == 2
            for t in trials:
                spec = ca.get(f"/api/jobs/{t['job_id']}").json()["spec"]
                assert spec["workspace"] == ws["ref"], spec
        finally:
            ca.post(f"/api/selections/{sel['id']}/cancel")


def test_a_tampered_job_row_naming_another_users_digest_fails_on_the_worker(stack: StackHandle) -> None:
    a, ca = _user(stack)
    _b, cb = _user(stack)
    with ca, cb:
        theirs = _workspace(cb)
        # a spec no route would have pinned: user a's job naming b's bytes by digest (stored whole,
        # with its defaults, as a submitted job's is)
        with session_for(stack.stack.database_url) as s:
            job = db_jobs.create_job(
                s,
                name="tampered",
                spec=JobSpec.model_validate(
                    {**SHORT, "name": "tampered", "workspace": theirs["ref"]}
                ).model_dump(),
                steps=3,
                owner_id=a["user"]["id"],
            )
        end = stack.wait(job.id, ("failed",), timeout=180)
        assert "only its owner's workspaces" in (end["error"] or ""), end["error"]
