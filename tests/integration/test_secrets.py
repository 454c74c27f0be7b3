"""Secrets out of reach, on `shardyard stack` as a user runs it (a real process of its own): no
process of the stack holds the admin token in its environment (/proc/<pid>/environ), the API reads
it from a file that is gone once the API is up, and failed token checks (Bearer tokens, sign-ins)
are limited per client address over real HTTP while live tokens are never refused."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from api.stack import free_port
from tests.stack_cli import proc_info, sigterm_and_wait, start_stack_cli

pytestmark = pytest.mark.integration

LIMIT = 4
WINDOW_S = 8


class CliStack:
    def __init__(self, *, root: Path, pid: int, base_url: str, headers: dict[str, str]) -> None:
        self.root = root
        self.pid = pid
        self.base_url = base_url
        self.headers = headers
        self.token = headers["Authorization"].removeprefix("Bearer ")


@pytest.fixture(scope="module")
def cli_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[CliStack]:
    root = tmp_path_factory.mktemp("secrets")
    port = free_port()
    env = {"SHARDYARD_AUTH_FAIL_LIMIT": str(LIMIT), "SHARDYARD_AUTH_FAIL_WINDOW_S": str(WINDOW_S)}
    proc, headers = start_stack_cli(root, port, root / "stack.log", env=env)
    try:
        yield CliStack(root=root, pid=proc.pid, base_url=f"http://127.0.0.1:{port}", headers=headers)
    finally:
        sigterm_and_wait(proc, root)


def descendants(pid: int) -> dict[int, str]:
    """Every live process under `pid` (children, theirs, ...), with its command line."""
    parents: dict[int, int] = {}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            _cmd, _cwd, state, ppid = proc_info(entry)
        except OSError:
            continue
        if state != "Z":
            parents[int(entry)] = ppid
    found: dict[int, str] = {}
    frontier = [pid]
    while frontier:
        parent = frontier.pop()
        for child, ppid in parents.items():
            if ppid == parent and child not in found:
                try:
                    found[child] = proc_info(child)[0]
                except OSError:
                    continue
                frontier.append(child)
    return found


def test_no_process_of_the_stack_holds_the_admin_token_in_its_environment(cli_stack: CliStack) -> None:
    # the API read the token: it is the admin's
    me = httpx.get(f"{cli_stack.base_url}/api/auth/me", headers=cli_stack.headers, timeout=10)
    assert me.status_code == 200 and me.json()["user"]["is_admin"], me.text
    procs = descendants(cli_stack.pid)
    kinds = {
        "api": [p for p, cmd in procs.items() if "uvicorn" in cmd and "api.asgi" in cmd],
        "scheduler": [p for p, cmd in procs.items() if "core.scheduler_proc" in cmd],
        "worker": [p for p, cmd in procs.items() if "celery" in cmd],
    }
    assert all(kinds.values()), (kinds, procs)
    for pid, cmd in procs.items():
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes()
        except OSError:
            continue  # gone meanwhile (a pool process recycled)
        names = [v.split(b"=", 1)[0].decode() for v in environ.split(b"\0") if v]
        assert cli_stack.token.encode() not in environ, f"{pid} {cmd[:120]} has the admin token"
        assert "SHARDYARD_ADMIN_TOKEN" not in names and "SHARDYARD_TOKEN" not in names, (pid, cmd[:120])
    # the file the API read it from is gone now that the API is up
    assert not list(cli_stack.root.glob(".admin-token*"))


def _get(stack: CliStack, token: str, **headers: str) -> httpx.Response:
    return httpx.get(
        f"{stack.base_url}/api/jobs", headers={"Authorization": f"Bearer {token}", **headers}, timeout=10
    )


def test_failed_token_checks_are_limited_per_address(cli_stack: CliStack) -> None:
    good = cli_stack.token
    # successes are never counted: far more than the limit of them pass
    for _ in range(LIMIT * 3):
        assert _get(cli_stack, good).status_code == 200
    start = time.monotonic()
    for _ in range(LIMIT):
        resp = _get(cli_stack, "sy_wrong")
        assert resp.status_code == 401 and "unknown or revoked" in resp.json()["detail"], resp.text
    # one more failure from this address: refused with when to come back
    resp = _get(cli_stack, "sy_wrong")
    assert resp.status_code == 429, resp.text
    assert "too many failed token checks" in resp.json()["detail"]
    assert 1 <= int(resp.headers["retry-after"]) <= WINDOW_S
    # the check before a body is read (POST) and the sign-in count against the same address
    post = httpx.post(
        f"{cli_stack.base_url}/api/jobs",
        json={"name": "x"},
        headers={"Authorization": "Bearer sy_wrong"},
        timeout=10,
    )
    assert post.status_code == 429 and "retry-after" in post.headers, post.text
    sign_in = httpx.post(f"{cli_stack.base_url}/api/auth/session", json={"token": "sy_wrong"}, timeout=10)
    assert sign_in.status_code == 429 and "retry-after" in sign_in.headers, sign_in.text
    # a live token is never refused, from the same address
    assert _get(cli_stack, good).status_code == 200
    signed = httpx.post(f"{cli_stack.base_url}/api/auth/session", json={"token": good}, timeout=10)
    assert signed.status_code == 200, signed.text
    # another address has its own count (uvicorn takes X-Forwarded-For from a loopback proxy)
    other = {"X-Forwarded-For": "203.0.113.9"}
    assert _get(cli_stack, "sy_wrong", **other).status_code == 401
    assert time.monotonic() - start < WINDOW_S, "too slow to test the window: the failures expired"
    # once the window has passed without a failure, the address is heard again
    time.sleep(WINDOW_S + 0.5)
    resp = _get(cli_stack, "sy_wrong")
    assert resp.status_code == 401, resp.text


def test_failed_sign_ins_alone_reach_the_limit(cli_stack: CliStack) -> None:
    address = {"X-Forwarded-For": "198.51.100.7"}
    for _ in range(LIMIT):
        resp = httpx.post(
            f"{cli_stack.base_url}/api/auth/session", json={"token": "sy_guess"}, headers=address, timeout=10
        )
        assert resp.status_code == 401, resp.text
    resp = httpx.post(
        f"{cli_stack.base_url}/api/auth/session", json={"token": "sy_guess"}, headers=address, timeout=10
    )
    assert resp.status_code == 429 and int(resp.headers["retry-after"]) >= 1, resp.text
    # and a Bearer guess from that address is refused alike
    assert _get(cli_stack, "sy_guess", **address).status_code == 429
