"""Shared fixtures. `stack` is the real thing: a redis-server on a free loopback port, the API
under uvicorn and a Celery worker process, over a fresh SQLite file (migrated by Alembic)."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from api.stack import Stack
from core.messages import parse_line
from db.connection import get_engine, session_for
from db.migrate import upgrade
from db.workers import record_heartbeat
from tests.sse import TOKENS

# Every process the tests start (stacks, workers, trainers) computes on one thread. The suite runs
# two pytest processes on two cores, often each with a trainer: with torch's default of a thread
# per core, OpenMP threads spin-wait on cores the other trainer holds, and one CI run under load
# saw a 50 ms step of long_job take 1.4 s. Set before any child starts; tests/gloo.py and the
# in-process trainer tests set their own.
os.environ.setdefault("OMP_NUM_THREADS", "1")

# The gate files that hold a test's job mid-run (tests/user_data.py HELD_BATCHES_PY) live in one
# folder every stack's sandboxed trainers see read-only (SHARDYARD_SANDBOX_READ_ONLY): a sandbox
# has a /tmp of its own, so a gate in the test's tmp_path would never hold the job. The folder
# exists before any stack starts (a spare trainer's sandbox binds what exists when it is made).
GATES = Path(os.environ.get("TMPDIR", "/tmp")) / f"shardyard-test-gates-{os.getuid()}"
GATES.mkdir(exist_ok=True)
os.environ.setdefault("SHARDYARD_SANDBOX_READ_ONLY", str(GATES))

TERMINAL = ("succeeded", "failed", "cancelled")
# short windows, so a dead worker's job is taken back within seconds: the stacks of the fault tests
LOST_WORKER_WINDOWS = {
    "SHARDYARD_HEARTBEAT_S": "0.5",
    "SHARDYARD_WORKER_ALIVE_S": "2",
    "SHARDYARD_LEASE_S": "3",
    "SHARDYARD_RECONCILE_S": "1",
}


def long_job(name: str, steps: int, *, checkpoint_every: int = 25) -> dict[str, Any]:
    """A job that a fault must land in the middle of. Its steps cost compute (about 50 ms each on
    an idle 2-core machine, 2-4x that under the test suite's own load), not service overhead: a
    tiny model over thousands of steps outlasts a fault just as well, but spends minutes relaying
    metrics, and the suite ran past its time budget. 300 steps leave ~14 s after step 10 idle."""
    return {
        "name": name,
        "model": {"kind": "mlp", "layers": 2, "d_model": 256, "seq_len": 32},
        "data": {"max_chars": 20_000},
        "train": {"steps": steps, "batch_size": 16, "eval_every": steps, "eval_batches": 1},
        "checkpoint_every": checkpoint_every,
    }


def grid_batch(
    name: str, base: dict[str, Any], space: dict[str, list[Any]], *, devices: int, **more: Any
) -> dict[str, Any]:
    """A selection batch's body (POST /api/selections): every point of `space` over `base`, on
    `devices` devices, with the other fields `more`."""
    return {"name": name, "base": base, "space": space, "method": "grid", "devices": devices, **more}


def checkpointed_job(name: str, *, steps: int, every: int) -> dict[str, Any]:
    """A one-layer GPT on the CPU that evaluates and checkpoints every `every` steps: a job whose
    checkpoints and weights a test downloads."""
    return {
        "name": name,
        "model": {"kind": "gpt", "layers": 1, "d_model": 32, "heads": 2, "seq_len": 16},
        "data": {"max_chars": 20_000},
        "train": {"steps": steps, "batch_size": 8, "lr": 3e-3, "eval_every": every, "eval_batches": 1},
        "checkpoint_every": every,
        "resources": {"device": "cpu"},
    }


def loss_series(out: str) -> dict[str, tuple[list[int], list[float]]]:
    """{"loss"|"val_loss": (steps, values)} from a trainer's stdout protocol lines."""
    series: dict[str, tuple[list[int], list[float]]] = {}
    for line in out.splitlines():
        msg = parse_line(line)
        if msg is not None and msg.kind == "metric" and msg.name in ("loss", "val_loss"):
            steps, values = series.setdefault(msg.name, ([], []))
            steps.append(msg.step)
            values.append(msg.value)
    return series


TINY_SPEC: dict[str, Any] = {
    "name": "tiny",
    "model": {"kind": "gpt", "layers": 2, "d_model": 32, "heads": 2, "seq_len": 32},
    "data": {"max_chars": 200_000},
    "train": {"steps": 40, "batch_size": 8, "lr": 3e-3, "eval_every": 20, "seed": 0},
}


class StackHandle:
    """The running stack and an HTTP client signed in as its admin (`token`)."""

    def __init__(self, stack: Stack) -> None:
        self.stack = stack
        self.base_url = stack.base_url
        self.token = stack.admin_token
        self.headers = {"Authorization": f"Bearer {self.token}"}
        # a connection idle for 2 s is not used again: uvicorn closes one idle for 5 s, and a
        # request sent on it as it closes gets no answer (one test of a shared stack, in CI)
        self.client = httpx.Client(
            base_url=stack.base_url,
            timeout=30,
            headers=self.headers,
            limits=httpx.Limits(keepalive_expiry=2.0),
        )
        TOKENS[stack.base_url] = self.token

    def submit(self, spec: dict[str, Any]) -> dict[str, Any]:
        resp = self.client.post("/api/jobs", json=spec)
        assert resp.status_code == 201, resp.text
        return resp.json()

    def submit_selection(self, body: dict[str, Any]) -> dict[str, Any]:
        resp = self.client.post("/api/selections", json=body)
        assert resp.status_code == 201, resp.text
        return resp.json()

    def job(self, job_id: int) -> dict[str, Any]:
        return self.client.get(f"/api/jobs/{job_id}").json()

    def cli(
        self, *args: str, stdin: str | None = None, timeout: float = 300
    ) -> subprocess.CompletedProcess[str]:
        """`shardyard ARGS` (python -m api.cli) against this stack, signed in as its admin."""
        env = {
            **os.environ,
            "SHARDYARD_API_URL": self.base_url,
            "SHARDYARD_TOKEN": self.token,
            "COLUMNS": "200",
        }
        return subprocess.run(
            [sys.executable, "-m", "api.cli", *args],
            input=stdin,
            capture_output=True,
            text=True,
            env=env,
            timeout=timeout,
        )

    def wait(
        self, job_id: int, statuses: tuple[str, ...] = ("succeeded",), timeout: float = 120
    ) -> dict[str, Any]:
        """Poll until the job reaches one of `statuses`; fail early if it ends in another."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            job = self.job(job_id)
            if job["status"] in statuses:
                return job
            if job["status"] in TERMINAL:
                raise AssertionError(f"job {job_id} ended {job['status']}, wanted {statuses}: {job['error']}")
            time.sleep(0.2)
        raise AssertionError(f"job {job_id} not {statuses} after {timeout}s: {self.job(job_id)}")

    def wait_selection(self, sid: int, timeout: float = 240) -> dict[str, Any]:
        """Poll until the selection batch ends, whatever its status."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            sel = self.client.get(f"/api/selections/{sid}").json()
            if sel["status"] in TERMINAL:
                return sel
            time.sleep(0.3)
        raise AssertionError(f"selection {sid} still {sel['status']} after {timeout}s: {sel}")

    def wait_until(self, job_id: int, predicate, timeout: float = 60) -> dict[str, Any]:  # noqa: ANN001
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            job = self.job(job_id)
            if predicate(job):
                return job
            time.sleep(0.1)
        raise AssertionError(f"job {job_id}: condition not met after {timeout}s: {self.job(job_id)}")


def beat(db_url: str, name: str, *, slots: int = 1, tasks: int = 1) -> None:
    """A worker's heartbeat written straight to the database, for the scheduler to place on: the
    cpu and gpu queues and its own, one CPU device, 64 GiB of host memory."""
    with session_for(db_url) as s:
        record_heartbeat(
            s,
            name=name,
            hostname="h",
            queues=["cpu", "gpu", f"node.{name}"],
            devices=[{"type": "cpu"}],
            host={"slots": slots, "tasks": tasks, "ram_bytes": 64 * 2**30, "cpus": 2},
        )


def together(race: Callable[..., None], args: Iterable[Any]) -> None:
    """Run `race(arg)` for every arg, each on its own thread, all at once, and wait for them all."""
    threads = [threading.Thread(target=race, args=(a,)) for a in args]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


@contextlib.contextmanager
def running(st: Stack) -> Iterator[StackHandle]:
    """Start `st` (its process logs printed when it fails to come up) and yield a handle to it;
    the client is closed and the stack stopped on the way out. The module-scoped stacks of the
    integration tests are made with it."""
    try:
        st.start()
    except Exception:
        for log in sorted(Path(st.root).glob("*.log")):
            print(f"---- {log.name}\n{log.read_text()[-3000:]}")
        raise
    handle = StackHandle(st)
    try:
        yield handle
    finally:
        handle.client.close()
        st.stop()


@pytest.fixture(scope="session")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[StackHandle]:
    root = tmp_path_factory.mktemp("stack")
    # the tests of refusals (revoked tokens, the fuzzer's sign-ins) fail many token checks from one
    # address on this shared stack: the limit on them has its own stack (test_secrets.py)
    env = {"SHARDYARD_SSE_KEEPALIVE_S": "1", "SHARDYARD_AUTH_FAIL_LIMIT": "100000"}
    st = Stack(root=root, workers=1, concurrency=2, extra_env=env)
    try:
        st.start()
    except Exception:
        for log in sorted(Path(root).glob("*.log")):
            print(f"---- {log.name}\n{log.read_text()[-3000:]}")
        raise
    handle = StackHandle(st)
    # the CLI processes and tests/sse.py the tests start find the admin token here
    os.environ["SHARDYARD_TOKEN"] = handle.token
    try:
        yield handle
    finally:
        os.environ.pop("SHARDYARD_TOKEN", None)
        handle.client.close()
        st.stop()


@pytest.fixture
def gate(tmp_path: Path) -> Iterator[Path]:
    """The gate file of a job held mid-run (tests/user_data.py, HELD_BATCHES_PY): there while the
    test runs (it deletes it to let the job go on), and gone at the test's end whatever happened,
    so that no held job outlives its test on a stack other tests share."""
    path = GATES / f"gate-{os.getpid()}-{time.monotonic_ns()}"
    path.touch()
    yield path
    path.unlink(missing_ok=True)


@pytest.fixture
def broker(tmp_path: Path) -> Iterator[Stack]:
    """A real redis-server of its own (no API, no worker), stopped after the test."""
    stack = Stack(root=tmp_path)
    stack.start_redis()
    try:
        yield stack
    finally:
        stack.stop()


@pytest.fixture(scope="session")
def pg_server() -> Iterator[str]:
    from tests.postgres import postgres_server

    with postgres_server() as url:
        yield url


@pytest.fixture(params=["sqlite", "postgres"])
def db_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """A fresh database brought to the latest migration by the real Alembic scripts: a SQLite file,
    or a new schema-less database on a real PostgreSQL server (same code; the URL decides).

    At the test's end this process's engine for it is disposed: `db.connection.get_engine` keeps one
    per URL for the process's life, so each test's pooled connections would otherwise stay open on
    the session's one server until it refused new clients (its max_connections)."""
    if request.param == "sqlite":
        url = f"sqlite:///{tmp_path / 'test.db'}"
    else:
        base = request.getfixturevalue("pg_server")
        name = f"t{abs(hash(request.node.nodeid)) % 10**9}"
        from sqlalchemy import create_engine, text

        admin = create_engine(base, isolation_level="AUTOCOMMIT")
        with admin.connect() as c:
            c.execute(text(f"DROP DATABASE IF EXISTS {name}"))
            c.execute(text(f"CREATE DATABASE {name}"))
        admin.dispose()
        url = base.rsplit("/", 1)[0] + f"/{name}"
    upgrade(url)
    try:
        yield url
    finally:
        get_engine(url).dispose()
