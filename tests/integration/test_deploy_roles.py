"""The compose deployment's own Redis users and PostgreSQL roles (docker/redis/, docker/postgres/)
are enough for what each process does, and no more: the API, the scheduler and a worker, each a
real process with its own credentials made by the same scripts the containers run, take jobs, a
cancel, a selection batch, webhooks, users and workspaces through to their ends with no denial in
either server's log; and each credential is refused what its process never does (a worker making
itself an admin or reading tokens, the API queueing a task, the scheduler publishing)."""

from __future__ import annotations

import os
import re
import secrets
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack
from functools import partial
from pathlib import Path

import httpx
import pytest
import redis
from sqlalchemy import create_engine, text
from sqlalchemy.exc import ProgrammingError

from api.stack import find_redis_server, free_port, worker_command
from tests.archives import targz
from tests.conftest import TINY_SPEC
from tests.postgres import find_pg_bin
from tests.proc_tree import logged_process
from tests.sse import read_sse
from tests.webhook_receiver import Receiver

ROOT = Path(__file__).resolve().parents[2]
DOCKER = ROOT / "docker"
ROLES = ("api", "scheduler", "worker")
_process = partial(logged_process, stop_s=20)
"""A service process of the deployment, its log appended to its file."""


def _until(check, *, what: str, timeout: float = 120):  # noqa: ANN001, ANN202
    deadline = time.monotonic() + timeout
    while True:
        try:
            if got := check():
                return got
        except (httpx.TransportError, redis.ConnectionError, KeyError, ValueError):
            pass  # not up yet
        assert time.monotonic() < deadline, f"{what}: not within {timeout:.0f}s"
        time.sleep(0.3)


class Deployment:
    """PostgreSQL and redis-server set up by the compose deployment's scripts, and the API, the
    scheduler and one worker as processes, each with its own role and Redis user."""

    def __init__(self, root: Path, stack: ExitStack) -> None:
        self.root, self.stack = root, stack
        self.pg_port, self.redis_port, self.api_port = free_port(), free_port(), free_port()
        self.db_pw = {r: secrets.token_hex(16) for r in ROLES}
        self.redis_pw = {r: secrets.token_hex(16) for r in (*ROLES, "ops")}
        self.signing_key = secrets.token_hex(32)
        self.admin_token = "sy_" + secrets.token_urlsafe(32)
        self.pg_log = root / "postgres.log"

    def db_url(self, role: str | None = None) -> str:
        who = f"shardyard_{role}:{self.db_pw[role]}" if role else "shardyard"
        return f"postgresql+psycopg2://{who}@127.0.0.1:{self.pg_port}/shardyard"

    def broker_url(self, user: str) -> str:
        return f"redis://{user}:{self.redis_pw[user]}@127.0.0.1:{self.redis_port}/0"

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.api_port}"

    def start_postgres(self) -> None:
        bindir = find_pg_bin()
        # outside pytest's folders, which only their owner may enter
        pg_root = Path(tempfile.mkdtemp(prefix="shardyard-roles-pg-"))
        self.stack.callback(shutil.rmtree, pg_root, ignore_errors=True)
        data = pg_root / "data"
        as_user: list[str] = []
        if os.geteuid() == 0:  # initdb refuses root
            shutil.chown(pg_root, "postgres", "postgres")
            as_user = ["runuser", "-u", "postgres", "--"]
        initdb = [str(bindir / "initdb"), "-D", str(data), "-A", "trust", "-U", "shardyard", "--no-sync"]
        subprocess.run([*as_user, *initdb], check=True, capture_output=True)
        server = [str(bindir / "postgres"), "-D", str(data), "-p", str(self.pg_port), "-k", str(pg_root)]
        server += ["-c", "listen_addresses=127.0.0.1", "-c", "fsync=off"]
        self.stack.enter_context(_process([*as_user, *server], log=self.pg_log, env=dict(os.environ)))
        pg_env = {**os.environ, "PATH": f"{bindir}:{os.environ['PATH']}", "PGHOST": "127.0.0.1"}
        pg_env["PGPORT"] = str(self.pg_port)
        _until(
            lambda: subprocess.run([str(bindir / "pg_isready")], env=pg_env).returncode == 0,
            what="postgres",
            timeout=30,
        )
        subprocess.run([str(bindir / "createdb"), "-U", "shardyard", "shardyard"], env=pg_env, check=True)
        # what the postgres image does with /docker-entrypoint-initdb.d/*.sh on a new volume
        env = {**pg_env, "POSTGRES_USER": "shardyard", "POSTGRES_DB": "shardyard"}
        env.update({f"SHARDYARD_DB_{r.upper()}_PASSWORD": pw for r, pw in self.db_pw.items()})
        subprocess.run(["sh", str(DOCKER / "postgres" / "init-roles.sh")], env=env, check=True)
        # the compose file's migrate service: migrations, then the grants, as the owner
        owner = {**_clean_env(), "SHARDYARD_DATABASE_URL": self.db_url()}
        subprocess.run([sys.executable, "-m", "db.migrate", self.db_url()], env=owner, cwd=ROOT, check=True)
        grants = [sys.executable, "-m", "db.grants", str(DOCKER / "postgres" / "grants.sql")]
        subprocess.run(grants, env=owner, cwd=ROOT, check=True)

    def start_redis(self) -> None:
        template = (DOCKER / "redis" / "users.acl.in").read_text()
        version = subprocess.run([find_redis_server(), "--version"], capture_output=True, text=True).stdout
        major, minor = map(int, re.search(r"v=(\d+)\.(\d+)", version).groups())
        if (major, minor) < (7, 2):
            # CLIENT SETINFO came with 7.2 (the compose file's image); an older server refuses to
            # load a rule naming it
            template = template.replace(" +client|setinfo", "")
        (self.root / "users.acl.in").write_text(template)
        env = {
            **os.environ,
            "PATH": f"{Path(find_redis_server()).parent}:{os.environ['PATH']}",
            "SHARDYARD_REDIS_ACL_TEMPLATE": str(self.root / "users.acl.in"),
            "SHARDYARD_REDIS_ACL_FILE": str(self.root / "users.acl"),
            "SHARDYARD_REDIS_RUN_AS": "",
        }
        env.update({f"SHARDYARD_REDIS_{u.upper()}_PASSWORD": pw for u, pw in self.redis_pw.items()})
        cmd = [
            "sh",
            str(DOCKER / "redis" / "start.sh"),
            "--port",
            str(self.redis_port),
            "--bind",
            "127.0.0.1",
        ]
        cmd += ["--save", "", "--dir", str(self.root)]
        self.stack.enter_context(_process(cmd, log=self.root / "redis.log", env=env))
        _until(lambda: self.ops().ping(), what="redis-server", timeout=20)

    def ops(self) -> redis.Redis:
        return redis.Redis.from_url(self.broker_url("ops"))

    def env(self, role: str) -> dict[str, str]:
        env = {
            **_clean_env(),
            "SHARDYARD_DATABASE_URL": self.db_url(role),
            "SHARDYARD_BROKER_URL": self.broker_url(role),
            "SHARDYARD_DATA_DIR": str(self.root / role),
            # each its own data folder, as containers; what they share goes through the store
            "SHARDYARD_STORAGE_URL": f"file://{self.root / 'store'}",
            "SHARDYARD_EMBEDDED_SCHEDULER": "false",
            "SHARDYARD_WEBHOOK_ALLOW": '["127.0.0.1/32"]',
            "SHARDYARD_HEARTBEAT_S": "1",
            "SHARDYARD_SCHEDULER_S": "0.5",
            "PYTHONUNBUFFERED": "1",
        }
        if role != "scheduler":  # the compose file gives the key to the API and the workers
            env["SHARDYARD_BROKER_SIGNING_KEY"] = self.signing_key
        return env

    def start_processes(self) -> None:
        api = [sys.executable, "-m", "uvicorn", "api.asgi:app", "--host", "127.0.0.1"]
        api += ["--port", str(self.api_port), "--log-level", "warning"]
        api_env = {**self.env("api"), "SHARDYARD_ADMIN_TOKEN": self.admin_token}
        self.stack.enter_context(_process(api, log=self.root / "api.log", env=api_env))
        scheduler = [sys.executable, "-c", "from api.cli import main; main()", "scheduler"]
        self.stack.enter_context(
            _process(scheduler, log=self.root / "scheduler.log", env=self.env("scheduler"))
        )
        worker = worker_command(queues="cpu,gpu", concurrency=2, name="w1@%h")
        self.stack.enter_context(_process(worker, log=self.root / "worker.log", env=self.env("worker")))
        client = self.client()
        _until(lambda: client.get("/api/health").json()["workers"], what="the API and the worker")

    def client(self) -> httpx.Client:
        auth = {"Authorization": f"Bearer {self.admin_token}"}
        return self.stack.enter_context(httpx.Client(base_url=self.base_url, headers=auth, timeout=30))


def _clean_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SHARDYARD_")}
    return {**env, "PYTHONPATH": str(ROOT)}


@pytest.fixture
def deployment(tmp_path: Path) -> Iterator[Deployment]:
    with ExitStack() as stack:
        d = Deployment(tmp_path, stack)
        d.start_postgres()
        d.start_redis()
        d.start_processes()
        yield d


def _ended(client: httpx.Client, path: str) -> dict:
    return _until(
        lambda: (got := client.get(path).json())["status"] in ("succeeded", "failed", "cancelled") and got,
        what=path,
        timeout=180,
    )


def _credentials_refuse_what_their_process_never_does(d: Deployment) -> None:
    """Each process's database role and Redis user is refused what that process never does."""
    for role, sql in [
        ("worker", "UPDATE users SET is_admin = true"),
        ("worker", "SELECT count(*) FROM api_tokens"),
        ("worker", "SELECT secret FROM webhooks"),
        ("worker", "DELETE FROM jobs"),
        ("worker", "CREATE TABLE mine (x int)"),
        ("scheduler", "INSERT INTO users (name, is_admin) VALUES ('eve', true)"),
        ("scheduler", "DELETE FROM job_events"),
        ("api", "UPDATE reservations SET owner = 'x'"),
    ]:
        engine = create_engine(d.db_url(role))
        with pytest.raises(ProgrammingError, match="permission denied"), engine.begin() as cx:
            cx.execute(text(sql))
        engine.dispose()
    node_queue = "node.w1@x"
    for user, act in [
        ("api", lambda r: r.lpush(node_queue, b"{}")),  # queue a task
        ("api", lambda r: r.publish("shardyard:job:1", b"{}")),  # forge a job's live message
        ("scheduler", lambda r: r.publish("shardyard:job:1", b"{}")),
        ("scheduler", lambda r: r.brpop([node_queue], 1)),  # take a task
        ("worker", lambda r: r.flushall()),
        ("worker", lambda r: r.config_get("requirepass")),
    ]:
        with redis.Redis.from_url(d.broker_url(user)) as r, pytest.raises(redis.exceptions.NoPermissionError):
            act(r)
    with redis.Redis(port=d.redis_port) as anonymous, pytest.raises(redis.AuthenticationError):
        anonymous.ping()


def test_each_process_works_with_its_own_credentials_and_only_those(deployment: Deployment) -> None:
    d = deployment
    c = d.client()
    hooks = Receiver()
    try:
        made = c.post("/api/webhooks", json={"url": hooks.url, "events": "all"})
        assert made.status_code == 201, made.text
        hook_id = made.json()["webhook"]["id"]
        ws = c.post(
            "/api/workspaces",
            params={"name": "text"},
            content=targz({"corpus.txt": b"the quick brown fox " * 2000}),
            headers={"content-type": "application/gzip"},
        ).json()

        # a job from a workspace, followed live to its end (the workers' signed messages)
        spec = {**TINY_SPEC, "name": "roles", "workspace": ws["ref"], "data": {"path": "corpus.txt"}}
        job = c.post("/api/jobs", json=spec).json()
        frames: list = []
        path = f"/api/jobs/{job['id']}/stream"
        follow = threading.Thread(
            target=lambda: frames.extend(read_sse(d.base_url, path, token=d.admin_token))
        )
        follow.start()
        # a missing grant fails the job or leaves it waiting: the test says so within minutes
        assert _ended(c, f"/api/jobs/{job['id']}")["status"] == "succeeded"
        follow.join(timeout=30)
        assert not follow.is_alive(), "the stream did not end with the job"
        assert [f[2]["status"] for f in frames if f[1] == "status"][-1] == "succeeded"
        assert len([f for f in frames if f[1] == "metric"]) >= TINY_SPEC["train"]["steps"]

        # a running job cancelled
        steps = {**TINY_SPEC["train"], "steps": 100_000}
        long = c.post("/api/jobs", json={**TINY_SPEC, "name": "long", "train": steps}).json()
        _until(lambda: c.get(f"/api/jobs/{long['id']}").json()["status"] == "running", what="the long job")
        assert c.post(f"/api/jobs/{long['id']}/cancel").status_code == 200
        assert _ended(c, f"/api/jobs/{long['id']}")["status"] == "cancelled"

        # a selection batch, followed to its end
        base = {**TINY_SPEC, "name": "sel", "train": {**TINY_SPEC["train"], "steps": 8, "eval_every": 4}}
        body = {"name": "s", "base": base, "space": {"train.lr": [1e-3, 3e-3]}, "method": "grid"}
        sel = c.post("/api/selections", json=body).json()
        assert _ended(c, f"/api/selections/{sel['id']}")["status"] == "succeeded"
        sel_frames = read_sse(d.base_url, f"/api/selections/{sel['id']}/stream", token=d.admin_token)
        assert [f[2]["status"] for f in sel_frames if f[1] == "status"] == ["succeeded"]
        assert any(f[1] == "metric" for f in sel_frames)

        # users and tokens, deletes
        user = c.post("/api/users", json={"name": "bob"}).json()["user"]
        assert c.post(f"/api/users/{user['id']}/tokens", json={"label": "x"}).status_code == 201
        assert c.delete(f"/api/users/{user['id']}/tokens").status_code == 200
        assert c.delete(f"/api/jobs/{job['id']}").status_code == 204
        assert c.delete(f"/api/workspaces/{ws['id']}").status_code == 204

        # the scheduler delivers the ends (the outbox triggers ran for the worker and the API)
        def delivered() -> list:
            items = c.get(f"/api/webhooks/{hook_id}/deliveries").json()["items"]
            return items if len(items) >= 3 and {i["state"] for i in items} == {"delivered"} else []

        _until(delivered, what="webhook deliveries", timeout=60)
    finally:
        hooks.close()

    # the API verified every live message the workers signed
    rejected = [
        line
        for line in c.get("/metrics").text.splitlines()
        if line.startswith("shardyard_live_messages_rejected")
    ]
    assert all(line.endswith(" 0.0") for line in rejected), rejected
    denials = d.ops().acl_log(count=50)
    assert denials == [], f"Redis refused a process something it needs: {denials}"
    refused = [line for line in d.pg_log.read_text().splitlines() if "permission denied" in line]
    assert refused == [], f"PostgreSQL refused a process something it needs: {refused}"

    _credentials_refuse_what_their_process_never_does(d)
