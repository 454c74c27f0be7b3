"""Requirement markers are parsed at submit, over real HTTP against the stack: a marker that is code
in env.pip (a job's, a selection base's) or in a workspace's requirements.txt (at upload) is
refused with 422 naming the field or the line and the rule, never stored to fail on a worker."""

from __future__ import annotations

import pytest

from tests.archives import targz
from tests.conftest import TINY_SPEC, StackHandle

pytestmark = pytest.mark.integration

EVIL = "einops; __import__('os').system('id')"
GZ = {"content-type": "application/gzip"}


def test_a_bad_marker_in_env_pip_is_refused_at_submit(stack: StackHandle) -> None:
    jobs_before = stack.client.get("/api/jobs").json()["total"]
    resp = stack.client.post("/api/jobs", json={**TINY_SPEC, "env": {"pip": ["einops==0.8.2", EVIL]}})
    assert resp.status_code == 422, resp.text
    detail = resp.json()["detail"]
    assert "env.pip[1]" in detail and "environment marker that is not PEP 508" in detail, detail
    assert "python_version" in detail  # the rule, with an example of a marker that is one
    base = {**TINY_SPEC, "env": {"pip": [EVIL]}}
    resp = stack.client.post(
        "/api/selections", json={"base": base, "space": {"train.lr": [1e-3, 2e-3]}, "method": "grid"}
    )
    assert resp.status_code == 422 and "env.pip[0]" in resp.json()["detail"], resp.text
    assert stack.client.get("/api/jobs").json()["total"] == jobs_before


def test_a_bad_marker_in_a_workspace_requirements_txt_is_refused_at_upload(stack: StackHandle) -> None:
    bad = targz({"requirements.txt": f"einops==0.8.2\n{EVIL}\n".encode(), "m.py": b"X = 1\n"})
    resp = stack.client.post("/api/workspaces", params={"name": "evil-marker"}, content=bad, headers=GZ)
    assert resp.status_code == 422, resp.text
    detail = resp.json()["detail"]
    assert "requirements.txt line 2" in detail and "environment marker that is not PEP 508" in detail, detail
    names = [w["name"] for w in stack.client.get("/api/workspaces").json()["items"]]
    assert "evil-marker" not in names
    # a requirements.txt in a folder of the archive is not the workspace's own: not read
    nested = targz({"sub/requirements.txt": f"{EVIL}\n".encode(), "m.py": b"X = 2\n"})
    assert stack.client.post("/api/workspaces", content=nested, headers=GZ).status_code == 201
    # a real marker, and lines only the worker can judge (options, pins), are accepted here
    ok = targz(
        {"requirements.txt": b'einops==0.8.2; python_version >= "3.10"\n-e ./mine\n', "m.py": b"X = 3\n"}
    )
    resp = stack.client.post("/api/workspaces", content=ok, headers=GZ)
    assert resp.status_code == 201, resp.text
