"""The production topology on one machine, in containers of the project's image (`make image`):
the API, the scheduler and two workers, each a podman container with its own /data volume and no
disk shared with any other; Postgres, Redis (with a password) and an S3-API server (moto's) run as
processes on this machine, since no image registry is reachable here to pull theirs from.

Everything listens on 127.0.0.1 only: the containers share the host's network namespace
(`--network host`), as the compose file's services share one network, so the two workers reach
each other's c10d and gloo ports the way two machines do, at loopback addresses of their own
(127.0.0.1, 127.0.0.2) instead of LAN addresses.

The workers run their trainers in bubblewrap's sandbox (workers/sandbox.py), as in production: a
worker's container is started with `--security-opt systempaths=unconfined` (WORKER_OPTIONS), without
which podman's masked /proc paths forbid the sandbox's own /proc (docs/deploy.md).
"""

from __future__ import annotations

import os
import secrets
import subprocess
import tempfile
import time
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx

from api.stack import find_redis_server, free_port
from tests.postgres import postgres_server
from tests.proc_tree import logged_process
from tests.s3 import S3Server

IMAGE = os.environ.get("SHARDYARD_IMAGE", "shardyard:latest")
PODMAN = ["podman", "--runtime", os.environ.get("PODMAN_RUNTIME", "runc")]
BUCKET = "shardyard"

# short windows, so a killed worker's job is taken back in seconds, not minutes
TIMINGS = {
    "SHARDYARD_HEARTBEAT_S": "1",
    "SHARDYARD_WORKER_ALIVE_S": "4",
    "SHARDYARD_LEASE_S": "6",
    "SHARDYARD_RECONCILE_S": "1",
    "SHARDYARD_SCHEDULER_S": "0.5",
    "SHARDYARD_GANG_JOIN_S": "120",
}

# the hardening docker/compose.yaml gives every service: no capability, no setuid gain
HARDENED = ["--cap-drop", "ALL", "--security-opt", "no-new-privileges"]
# the API and the scheduler write only their /data volume and /tmp (compose: read_only, tmpfs)
READ_ONLY = ["--read-only", "--read-only-tmpfs=false", "--tmpfs", "/tmp"]
# what a worker's container needs for the trainers' sandbox (docs/deploy.md): podman masks paths of
# /proc (/proc/kcore, /proc/keys, ...) by mounting over them, and the kernel lets a user namespace
# mount a /proc of its own only where the container's /proc has nothing mounted over it.
# (Podman's default seccomp profile lets an unprivileged process make a user namespace; Docker's
# does not, so compose.yaml also gives its workers seccomp=unconfined.)
WORKER_OPTIONS = [*HARDENED, "--security-opt", "systempaths=unconfined"]
WORKER_ADDRS = {"w1": "127.0.0.1", "w2": "127.0.0.2"}


def podman(*args: str, check: bool = True, timeout: float = 120, **kw: Any) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*PODMAN, *args], check=check, timeout=timeout, capture_output=True, text=True, **kw
    )


def _rlimits() -> list[str]:
    """Explicit rlimits below this shell's hard ones: podman's defaults (the host's own values)
    are refused where podman runs inside a limited container."""
    import resource

    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    nofile = 8192 if hard == resource.RLIM_INFINITY else min(hard, 8192)
    return ["--ulimit", f"nofile={nofile}:{nofile}", "--ulimit", "nproc=4096:4096"]


def _until(check: Callable[[], Any], *, what: str, timeout: float) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        try:
            if got := check():
                return got
        except (httpx.TransportError, ValueError, KeyError):
            pass  # not up yet
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout:.0f}s")
        time.sleep(0.5)


class Topology:
    """Host services and the containers; `start` brings everything up, `close` removes it all."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.run = secrets.token_hex(3)
        self.api_port = free_port()
        self.redis_port = free_port()
        self.redis_password = secrets.token_urlsafe(16)
        self.admin_token = "sy_" + secrets.token_urlsafe(32)
        self.s3 = S3Server(log=root / "s3.log")
        """moto's S3 server (tests/s3.py, as the storage tests use it), started by `start`"""
        self.database_url = ""
        self.containers: list[str] = []
        self.volumes: list[str] = []
        self.reference: subprocess.Popen[str] | None = None
        """the gang test's one-node run (tests/containers/test_topology.py starts it)"""
        self._stack = ExitStack()
        self.client = httpx.Client(
            base_url=f"http://127.0.0.1:{self.api_port}",
            headers={"Authorization": f"Bearer {self.admin_token}"},
            timeout=30,
        )

    # ---- names ----
    def name(self, role: str) -> str:
        return f"sy-{self.run}-{role}"

    @property
    def workers(self) -> list[str]:
        return [self.name("w1"), self.name("w2")]

    def celery_name(self, container: str) -> str:
        """A worker's name as the API reports it (Celery's default, celery@<container hostname>)."""
        return f"celery@{container}"

    # ---- host services ----
    def _start_postgres(self) -> None:
        self.database_url = self._stack.enter_context(postgres_server())

    def _start_redis(self) -> None:
        (self.root / "redis").mkdir(parents=True, exist_ok=True)
        cmd = [find_redis_server(), "--port", str(self.redis_port), "--bind", "127.0.0.1"]
        cmd += ["--requirepass", self.redis_password, "--save", "", "--dir", str(self.root / "redis")]
        self._stack.enter_context(logged_process(cmd, log=self.root / "redis.log"))

    def _start_s3(self) -> None:
        self.s3.start()
        self._stack.callback(self.s3.stop)
        self.s3.create_bucket(BUCKET)

    @property
    def s3_url(self) -> str:
        return self.s3.endpoint

    @property
    def broker_url(self) -> str:
        return f"redis://:{self.redis_password}@127.0.0.1:{self.redis_port}/0"

    # ---- containers ----
    def env(self) -> dict[str, str]:
        return {
            "SHARDYARD_DATABASE_URL": self.database_url,
            "SHARDYARD_BROKER_URL": self.broker_url,
            "SHARDYARD_EMBEDDED_SCHEDULER": "false",
            "SHARDYARD_STORAGE_URL": f"s3://{BUCKET}/shardyard",
            **self.s3.env,
            "OMP_NUM_THREADS": "1",
            **TIMINGS,
        }

    def _run(
        self,
        role: str,
        command: list[str],
        *,
        extra: dict[str, str] | None = None,
        options: list[str] | None = None,
        addr: str = "127.0.0.1",
    ) -> str:
        name = self.name(role)
        volume = f"{name}-data"
        env = {**self.env(), **(extra or {})}
        # the hostname resolves to loopback, as a machine's own name does (torchrun's standalone
        # rendezvous and gloo look it up)
        args = ["run", "-d", "--name", name, "--hostname", name, "--add-host", f"{name}:{addr}"]
        args += ["--network", "host", *_rlimits(), *(options or [])]
        args += ["-v", f"{volume}:/data"]
        for key, value in env.items():
            args += ["-e", f"{key}={value}"]
        self.containers.append(name)
        self.volumes.append(volume)
        podman(*args, IMAGE, *command)
        return name

    def start_api(self) -> None:
        self._run(
            "api",
            ["shardyard", "serve", "--host", "127.0.0.1", "--port", str(self.api_port)],
            extra={"SHARDYARD_ADMIN_TOKEN": self.admin_token},
            options=[*HARDENED, *READ_ONLY],
        )
        _until(
            lambda: self.client.get("/api/health").json()["db"]["ok"],
            what="the API container",
            timeout=120,
        )

    def start_scheduler(self) -> None:
        self._run("scheduler", ["shardyard", "scheduler"], options=[*HARDENED, *READ_ONLY])

    def start_worker(self, role: str) -> None:
        # one rank slot each: a 2-rank job must span both containers. Each its own loopback address,
        # as two machines have their own: torchrun's c10d rendezvous tells its agents apart by
        # address and pid, and in its sandbox every node's torchrun has the same pid
        addr = WORKER_ADDRS[role]
        self._run(
            role,
            ["shardyard", "worker", "--queues", "cpu,gpu"],
            extra={"SHARDYARD_WORKER_SLOTS": "1", "SHARDYARD_NODE_ADDR": addr},
            options=WORKER_OPTIONS,
            addr=addr,
        )

    def live_workers(self) -> set[str]:
        return {w["name"] for w in self.client.get("/api/health").json()["workers"]}

    def wait_workers(self, containers: list[str], timeout: float = 180) -> None:
        want = {self.celery_name(c) for c in containers}
        _until(
            lambda: want <= self.live_workers(), what=f"workers {sorted(want)} registered", timeout=timeout
        )

    def start(self) -> Topology:
        self.root.mkdir(parents=True, exist_ok=True)
        try:
            self._start_postgres()
            self._start_redis()
            self._start_s3()
            self.start_api()  # migrates the database before the others start
            self.start_scheduler()
            self.start_worker("w1")
            self.start_worker("w2")
            self.wait_workers(self.workers)
        except BaseException:
            self.dump_logs()
            self.close()
            raise
        return self

    # ---- reading and faults ----
    def healthcheck(self, container: str) -> subprocess.CompletedProcess:
        """The image's own HEALTHCHECK, run now."""
        return podman("healthcheck", "run", container, check=False, timeout=60)

    def run_once(self, *cmd: str) -> subprocess.Popen[str]:
        """A throwaway container of the image running `cmd` (started now, read by the caller)."""
        name = self.name("once-" + secrets.token_hex(2))
        args = ["run", "--rm", "--name", name, "--hostname", name, "--add-host", f"{name}:127.0.0.1"]
        args += ["--network", "host", *_rlimits(), "-e", "OMP_NUM_THREADS=1", IMAGE, *cmd]
        return subprocess.Popen(
            [*PODMAN, *args],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )

    def exec(self, container: str, *cmd: str) -> str:
        """`cmd` run in a running container (as its user); its stdout, stripped."""
        return podman("exec", container, *cmd, timeout=60).stdout.strip()

    def host_pids(self, container: str) -> list[int]:
        """The container's processes, by their ids on this machine."""
        out = podman("top", container, "hpid", timeout=60).stdout.split()
        return [int(p) for p in out if p.isdigit()]

    def container_pids(self, container: str) -> list[list[Any]]:
        """The container's processes as [pid, name]: the ids its own PID namespace gives them."""
        rows = podman("top", container, "pid", "comm", timeout=60).stdout.splitlines()[1:]
        return [
            [int(pid), name.strip()]
            for pid, _, name in (r.strip().partition(" ") for r in rows)
            if pid.isdigit()
        ]

    def kill(self, container: str) -> None:
        podman("kill", "--signal", "KILL", container)

    def logs(self, container: str, tail: int = 60) -> str:
        out = podman("logs", "--tail", str(tail), container, check=False)
        return out.stdout + out.stderr

    def dump_logs(self) -> None:
        for c in self.containers:
            print(f"---- container {c}\n{self.logs(c)}")
        for log in sorted(self.root.glob("*.log")):
            print(f"---- {log.name}\n{log.read_text(errors='replace')[-2000:]}")

    def close(self) -> None:
        self.client.close()
        for c in reversed(self.containers):
            podman("rm", "-f", "-t", "5", c, check=False, timeout=60)
        for v in self.volumes:
            podman("volume", "rm", "-f", v, check=False)
        self._stack.close()


def make_root() -> Path:
    return Path(tempfile.mkdtemp(prefix="shardyard-containers-"))
