"""Request limits and admission, over real HTTP against the stack: each limit answers 4xx naming
the rule (never 500), and a job no worker could ever run is refused with the numbers."""

from __future__ import annotations

import contextlib
import json
import secrets
import select
import socket
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import TINY_SPEC, StackHandle

pytestmark = pytest.mark.integration

HUGE = 2**70


def with_(**fields: Any) -> dict[str, Any]:
    return json.loads(json.dumps({**TINY_SPEC, **fields}))


def test_body_size_is_limited(stack: StackHandle) -> None:
    big = b'{"name": "' + b"x" * (2 * 2**20) + b'"}'
    resp = stack.client.post("/api/jobs", content=big, headers={"Content-Type": "application/json"})
    assert resp.status_code == 413 and "limit" in resp.json()["detail"]

    def chunks():  # no Content-Length: counted as it arrives
        for _ in range(40):
            yield b"x" * 65536

    resp = stack.client.post("/api/jobs", content=chunks(), headers={"Content-Type": "application/json"})
    assert resp.status_code == 413


def test_non_json_bodies_are_refused_on_every_post(stack: StackHandle) -> None:
    for path in ("/api/jobs", "/api/selections", "/api/users", "/api/jobs/1/cancel", "/api/auth/session"):
        resp = stack.client.post(path, content=b"{}", headers={"Content-Type": "text/plain"})
        assert resp.status_code == 415, path
        assert "application/json" in resp.json()["detail"]


def test_foreign_host_header_is_refused(stack: StackHandle) -> None:
    resp = stack.client.get("/api/jobs", headers={"Host": "evil.example"})
    assert resp.status_code == 400
    assert stack.client.get("/api/jobs", headers={"Host": "localhost"}).status_code == 200


@pytest.mark.parametrize(
    "path",
    [
        f"/api/jobs/{HUGE}",
        f"/api/jobs/{HUGE}/cancel",
        f"/api/jobs?offset={HUGE}",
        f"/api/jobs/1/metrics?since_step={HUGE}",
        f"/api/jobs/1/logs?after_id={HUGE}",
        f"/api/selections/{HUGE}",
        f"/api/selections?offset={HUGE}",
        f"/api/tokens/{HUGE}",
        f"/api/workspaces?offset={HUGE}",
        f"/api/workspaces/{HUGE}",
    ],
)
def test_integers_beyond_the_database_range_are_422(stack: StackHandle, path: str) -> None:
    method = (
        "POST"
        if path.endswith("cancel")
        else "DELETE"
        if "tokens" in path or "workspaces/" in path
        else "GET"
    )
    resp = stack.client.request(method, path)
    assert resp.status_code == 422, resp.text
    assert "less than or equal" in resp.json()["detail"]


def test_stream_cursor_beyond_the_database_range_is_422(stack: StackHandle) -> None:
    job = stack.submit(with_(name="cursor", train={**TINY_SPEC["train"], "steps": 2}))
    resp = stack.client.get(f"/api/jobs/{job['id']}/stream", headers={"Last-Event-ID": f"m{HUGE}e0"})
    assert resp.status_code == 422 and "Last-Event-ID" in resp.json()["detail"]
    # the ids a stream lists above its horizon: huge ones, or too many digits in all (an id too
    # long for int() would be a 500), are refused as well, by header and by query alike
    long_id = "m0e0s" + ".".join(["9" * 18] * 20)
    for headers, params in (({"Last-Event-ID": f"m0e0s1.{HUGE}"}, {}), ({}, {"last_event_id": long_id})):
        resp = stack.client.get(f"/api/jobs/{job['id']}/stream", headers=headers, params=params)
        assert resp.status_code == 422 and "Last-Event-ID" in resp.text, resp.text


def test_non_finite_floats_and_control_characters_are_refused(stack: StackHandle) -> None:
    for bad in ("NaN", "Infinity", "-Infinity"):
        body = json.dumps(TINY_SPEC).replace('"lr": 0.003', f'"lr": {bad}')
        resp = stack.client.post("/api/jobs", content=body, headers={"Content-Type": "application/json"})
        assert resp.status_code == 422 and "train.lr" in resp.json()["detail"], (bad, resp.text)
    resp = stack.client.post("/api/jobs", json=with_(name="bell\x07job"))
    assert resp.status_code == 422 and resp.json()["errors"][0]["field"] == "name"


def test_error_messages_do_not_echo_huge_inputs(stack: StackHandle) -> None:
    key = "k" * 100_000
    for body in (with_(name="n" * 500_000), {**TINY_SPEC, key: 1}):
        resp = stack.client.post("/api/jobs", json=body)
        assert resp.status_code == 422
        assert len(resp.text) < 5000
    sel = {"base": TINY_SPEC, "space": {key: [1, 2]}, "trials": 2}
    resp = stack.client.post("/api/selections", json=sel)
    assert resp.status_code == 422 and len(resp.text) < 5000


def test_search_spaces_are_bounded_before_expansion(stack: StackHandle) -> None:
    deep: Any = 1
    for _ in range(900):
        deep = [deep]
    sel = {"base": TINY_SPEC, "space": {"train.seed": [deep]}, "trials": 1}
    resp = stack.client.post("/api/selections", json=sel)
    assert resp.status_code == 422 and "nested" in resp.json()["detail"]
    # shallow enough for the parser, still not a value any field takes
    sel["space"] = {"train.seed": [[[[1]]]]}
    resp = stack.client.post("/api/selections", json=sel)
    assert resp.status_code == 422 and "each value must be" in resp.json()["detail"]
    sel = {"base": TINY_SPEC, "space": {"train.lr": {"low": 0.001, "high": 0.1, "num": 2_000_000}}}
    t0 = time.monotonic()
    resp = stack.client.post("/api/selections", json={**sel, "method": "grid"})
    assert resp.status_code == 422 and "more than the limit of 1024" in resp.json()["detail"]
    print(f"2,000,000-point range refused in {time.monotonic() - t0:.3f}s")


def _user(stack: StackHandle, **quota: int) -> httpx.Client:
    resp = stack.client.post("/api/users", json={"name": f"q{secrets.token_hex(4)}", **quota})
    assert resp.status_code == 201, resp.text
    token = resp.json()["token"]
    return httpx.Client(base_url=stack.base_url, timeout=30, headers={"Authorization": f"Bearer {token}"})


def test_jobs_no_worker_could_run_are_refused_with_the_numbers(stack: StackHandle) -> None:
    host = stack.client.get("/api/health").json()["workers"][0]["host"]
    assert host["slots"] >= 1 and host["ram_bytes"] > 2**30
    # a 262,144-rank layout: beyond any quota and any worker
    layout = with_(
        model={"kind": "gpt", "layers": 4, "d_model": 4096, "heads": 64, "seq_len": 64},
        train={**TINY_SPEC["train"], "batch_size": 4096},
        parallel={"tensor": {"mode": "2.5d", "q": 64, "d": 64}},
    )
    resp = stack.client.post("/api/jobs", json=layout)
    assert resp.status_code == 422 and "262144 ranks" in resp.json()["detail"], resp.text
    # more ranks than the largest worker's slots, for a user whose quota would allow it
    with _user(stack, max_ranks=1_000_000) as c:
        q = next(q for q in range(2, 64) if q * q > host["slots"] and 64 % q == 0)
        wide = with_(
            model={"kind": "gpt", "layers": 2, "d_model": 64 * q, "heads": q, "seq_len": 16},
            train={**TINY_SPEC["train"], "batch_size": q},
            parallel={"tensor": {"mode": "2d", "q": q}},
        )
        resp = c.post("/api/jobs", json=wide)
        assert resp.status_code == 422, resp.text
        assert f"needs {q * q} ranks" in resp.json()["detail"]
        assert f"has {host['slots']} slots" in resp.json()["detail"]
    # a model far larger than the worker's RAM: the numbers are in the answer
    big = with_(
        model={"kind": "gpt", "layers": 256, "d_model": 16384, "heads": 128, "seq_len": 64},
        train={**TINY_SPEC["train"], "batch_size": 8},
    )
    resp = stack.client.post("/api/jobs", json=big)
    detail = resp.json()["detail"]
    assert resp.status_code == 422 and "host memory" in detail and "GiB of RAM" in detail, detail
    # batch 65,536 x seq 8,192: the activations alone
    wide_batch = with_(
        model={"kind": "gpt", "layers": 2, "d_model": 32, "heads": 2, "seq_len": 8192},
        train={**TINY_SPEC["train"], "batch_size": 65536},
    )
    resp = stack.client.post("/api/jobs", json=wide_batch)
    assert resp.status_code == 422 and "activations" in resp.json()["detail"]


def test_quota_refuses_what_never_fits_and_queues_what_must_wait(stack: StackHandle) -> None:
    with _user(stack, max_ranks=1) as c:
        piped = with_(parallel={"pipeline": {"stages": 2, "microbatches": 2}})
        resp = c.post("/api/jobs", json=piped)
        assert resp.status_code == 422 and "quota of 1 ranks" in resp.json()["detail"]
    with _user(stack, max_running_jobs=1) as c:
        long = {**TINY_SPEC["train"], "steps": 1_000_000}
        first = c.post("/api/jobs", json=with_(name="first", train=long)).json()
        stack.wait_until(first["id"], lambda j: j["status"] == "running", timeout=120)
        second = c.post(
            "/api/jobs", json=with_(name="second", train={**TINY_SPEC["train"], "steps": 3})
        ).json()
        # the worker has a free slot but the owner's quota is full: it waits, saying why
        waiting = stack.wait_until(second["id"], lambda j: j["wait_reason"] is not None, timeout=60)
        assert waiting["status"] == "queued"
        assert "quota is 1" in waiting["wait_reason"]
        assert stack.job(first["id"])["status"] == "running"
        # when the first ends, the second is sent again and runs
        assert c.post(f"/api/jobs/{first['id']}/cancel").status_code == 200
        stack.wait(first["id"], ("cancelled",), timeout=120)
        done = stack.wait(second["id"], timeout=180)
        assert done["wait_reason"] is None


def test_max_runtime_s_is_enforced(stack: StackHandle) -> None:
    job = stack.submit(
        with_(name="too-long", max_runtime_s=2, train={**TINY_SPEC["train"], "steps": 1_000_000})
    )
    done = stack.wait(job["id"], ("failed",), timeout=120)
    assert "max_runtime_s (2 s over all its attempts)" in done["error"]


def test_workspace_refs_beyond_the_database_range_read_as_absent(stack: StackHandle) -> None:
    assert stack.client.get(f"/api/workspaces/{HUGE}").status_code == 404
    # the spec allows 18 digits: past the INTEGER column, before any 500
    resp = stack.client.post("/api/jobs", json=with_(workspace=str(10**17)))
    assert resp.status_code == 422 and "not found" in resp.json()["detail"]


def _memory_kb(pid: int) -> dict[str, int]:
    """VmRSS and VmHWM (peak resident memory) of a process, in kB, from /proc."""
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            fields[key] = int(value.split()[0])
    return fields


def _anonymous_upload(port: int, size: int, out: list[str]) -> None:
    """POST `size` bytes to the workspace upload without a token, over a raw socket: send until
    the server answers (or stops reading), then keep its status line."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=60)
    try:
        sock.sendall(
            f"POST /api/workspaces HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/gzip\r\n"
            f"Content-Length: {size}\r\nConnection: close\r\n\r\n".encode()
        )
        chunk = b"\0" * 2**20
        sent = 0
        sock.setblocking(False)
        while sent < size:
            readable, writable, _ = select.select([sock], [sock], [], 10)
            if readable:
                break  # an answer before the body: stop sending
            if writable:
                try:
                    sent += sock.send(chunk[: size - sent])
                except (BlockingIOError, InterruptedError):
                    pass
                except (BrokenPipeError, ConnectionResetError):
                    break
        sock.setblocking(True)
        answer = b""
        with contextlib.suppress(ConnectionResetError):
            while b"\r\n" not in answer and (part := sock.recv(4096)):
                answer += part
        out.append(answer.split(b"\r\n", 1)[0].decode())
    finally:
        sock.close()


def test_anonymous_uploads_cost_the_api_no_memory(stack: StackHandle) -> None:
    """Four 95 MB uploads at once, without a token, under the 100 MiB cap: each is refused on its
    headers (401), and the API's peak memory stays within a few MB of idle. Reading them before
    the token check held all four in memory: the peak grew by ~400 MB."""
    pid = stack.stack.procs["api"].pid
    Path(f"/proc/{pid}/clear_refs").write_text("5")  # VmHWM starts again from the current VmRSS
    idle = _memory_kb(pid)
    answers: list[str] = []
    threads = [
        threading.Thread(target=_anonymous_upload, args=(stack.stack.api_port, 95_000_000, answers))
        for _ in range(4)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    after = _memory_kb(pid)
    assert answers == ["HTTP/1.1 401 Unauthorized"] * 4, answers
    grew_mb = (after["VmHWM"] - idle["VmRSS"]) / 1024
    assert grew_mb < 16, f"the API's peak memory grew {grew_mb:.0f} MB (idle {idle}, after {after})"
    assert stack.client.get("/api/health").status_code == 200


def test_no_body_is_read_before_the_caller_is_known(stack: StackHandle) -> None:
    def chunks():  # no Content-Length: the size is unknown until it is read
        for _ in range(4):
            yield b'{"name": "x"}'

    anon = httpx.Client(base_url=stack.base_url, timeout=30)
    with anon:
        resp = anon.post("/api/jobs", content=chunks(), headers={"Content-Type": "application/json"})
        assert resp.status_code == 401 and resp.headers["www-authenticate"] == "Bearer"
        bad = {"Authorization": "Bearer sy_made_up", "Content-Type": "application/json"}
        resp = anon.post("/api/jobs", content=b"{}", headers=bad)
        assert resp.status_code == 401 and "unknown or revoked" in resp.json()["detail"]
        # the sign-in reads a body without a caller, but only a small one
        resp = anon.post(
            "/api/auth/session", content=b"x" * 20_000, headers={"Content-Type": "application/json"}
        )
        assert resp.status_code == 413 and "16384" in resp.json()["detail"]


def test_names_are_not_blank_and_long_numbers_name_their_field(stack: StackHandle) -> None:
    for blank in ("   ", "\u3000"):
        resp = stack.client.post("/api/jobs", json=with_(name=blank))
        assert resp.status_code == 422 and resp.json()["errors"][0]["field"] == "name", resp.text
        assert "must hold a visible character" in resp.json()["detail"]
    for bad in ("a\u202egnp.exe", "c1\x85control"):  # a direction override, a C1 control
        resp = stack.client.post("/api/jobs", json=with_(name=bad))
        assert resp.status_code == 422 and resp.json()["errors"][0]["field"] == "name", resp.text
    digits = "9" * 5000
    body = json.dumps(TINY_SPEC).replace('"steps": 40', f'"steps": {digits}')
    resp = stack.client.post("/api/jobs", content=body, headers={"Content-Type": "application/json"})
    assert resp.status_code == 422, resp.text
    assert resp.json()["errors"][0]["field"] == "train.steps" and "5000 digits" in resp.json()["detail"]
    assert len(resp.text) < 1000  # the number is not echoed
    sel = json.dumps({"base": TINY_SPEC, "space": {"train.lr": [1, 2]}, "trials": 2})
    sel = sel.replace("[1, 2]", f"[1, -{digits}]")
    resp = stack.client.post("/api/selections", content=sel, headers={"Content-Type": "application/json"})
    assert resp.status_code == 422 and resp.json()["errors"][0]["field"] == "space.train.lr.1", resp.text
    # the same digits in a string are only a long name
    resp = stack.client.post(
        "/api/jobs", json=with_(name="9" * 150, train={**TINY_SPEC["train"], "steps": 1})
    )
    assert resp.status_code == 201, resp.text
    stack.client.post(f"/api/jobs/{resp.json()['id']}/cancel")
