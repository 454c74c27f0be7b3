"""The server's own `shardyard` commands: `serve`, `worker`, `stack`, `migrate`, `healthcheck`,
`admin create-user` (api/cli.py loads this module when one of them runs; the standalone scheduler
is api/scheduler_command.py).

Nothing here may import prometheus_client, even through another module: `serve` chooses the
multiprocess folder before the API process first imports it (core/multiproc.py says why).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import sys
import threading
from pathlib import Path

import uvicorn

import api.stack
from api.auth import issue_token
from api.healthcheck import Unhealthy, healthcheck
from api.hosts import own_hostnames
from core.multiproc import MULTIPROC_ENV, runtime_multiproc_dir
from core.settings import get_settings
from db.connection import session_for
from db.jobs import Conflict
from db.migrate import upgrade
from db.users import create_user
from shardyard.cli import CliError, console, err, follow
from shardyard.client import Client
from shardyard.errors import ShardyardError

DEMO_SPEC = Path(__file__).resolve().parent / "demo_spec.json"


def cmd_migrate(_args: argparse.Namespace) -> int:
    url = get_settings().database_url
    upgrade(url)
    console.print(f"database {url} is at the latest migration")
    return 0


def cmd_admin_create_user(args: argparse.Namespace) -> int:
    """Straight to the database (the way to make the first admin): prints the token once."""
    if not re.fullmatch(r"[A-Za-z0-9_.@-]{1,64}", args.name):
        raise CliError("name: 1-64 letters, digits or _ . @ -")
    cmd_migrate(args)
    with session_for(get_settings().database_url) as s:
        try:
            user = create_user(s, name=args.name, is_admin=args.admin)
        except Conflict as e:
            raise CliError(str(e)) from e
        secret, _ = issue_token(s, user_id=user.id, label="cli")
    role = "admin" if args.admin else "user"
    err.print(f"created {role} {args.name}; the token is shown this once (export SHARDYARD_TOKEN=...):")
    print(secret)
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    cmd_migrate(args)
    # the embedded scheduler is a child process: its instruments reach /metrics through this
    # folder (core/telemetry.py); set before anything imports prometheus_client. In memory, not
    # in the data dir: a full data disk would SIGBUS the API through the mapped files
    if not os.environ.get(MULTIPROC_ENV):
        data_dir = get_settings().data_dir.resolve()
        os.environ[MULTIPROC_ENV] = str(runtime_multiproc_dir(f"{data_dir}:{args.port}"))
    uvicorn.run("api.asgi:app", host=args.host, port=args.port, timeout_graceful_shutdown=3)
    return 0


def cmd_worker(args: argparse.Namespace) -> int:
    cmd_migrate(args)
    cmd = api.stack.worker_command(queues=args.queues, concurrency=args.concurrency)
    os.execvp(cmd[0], cmd)


def cmd_healthcheck(_args: argparse.Namespace) -> int:
    try:
        console.print(healthcheck(), highlight=False)
    except Unhealthy as e:
        raise CliError(f"unhealthy: {e}") from e
    return 0


def _follow_demo(stack: api.stack.Stack, job_id: int) -> None:
    """The demo job's progress, in a thread of its own: the main thread supervises the stack."""
    try:
        with Client(stack.base_url, stack.admin_token) as c:
            follow(c, job_id)
        console.print(f"[bold green]dashboard:[/] {stack.base_url}/#/jobs/{job_id}")
        console.print("the stack keeps running; press Ctrl-C to stop everything")
    except (CliError, ShardyardError) as e:
        err.print(f"[yellow]stopped following job {job_id}: {e}[/]")


def _trusted_hosts_env() -> dict[str, str]:
    """The dashboard opened by this machine's own name (a tunnel, /etc/hosts) is let in too, unless
    the operator listed the hosts themselves (api/hosts.py: why that name is safe to allow)."""
    if "SHARDYARD_TRUSTED_HOSTS" in os.environ:
        return {}
    hosts = [*get_settings().trusted_hosts, *own_hostnames()]
    return {"SHARDYARD_TRUSTED_HOSTS": json.dumps(list(dict.fromkeys(hosts)))}


def _say_started(stack: api.stack.Stack, root: Path) -> None:
    console.print(f"[bold green]dashboard:[/] {stack.base_url}/")
    console.print(
        f"[bold]admin token[/] (sign in to the dashboard with it; kept in {root / api.stack.ADMIN_TOKEN_FILE}, "
        f"the same after a restart of this --root):\n{stack.admin_token}",
        highlight=False,
    )
    console.print(
        f"CLI and SDK, in your shell:\n  export SHARDYARD_API_URL={stack.base_url}\n"
        f"  export SHARDYARD_TOKEN={stack.admin_token}",
        highlight=False,
        soft_wrap=True,
    )


def _submit_demo(stack: api.stack.Stack) -> None:
    with Client(stack.base_url, stack.admin_token) as c:
        spec = json.loads(DEMO_SPEC.read_text())
        job = c.submit(spec)
    console.print(f"submitted demo job {job.id} ({spec['name']}): {stack.base_url}/#/jobs/{job.id}")
    threading.Thread(target=_follow_demo, args=(stack, job.id), daemon=True, name="demo").start()


def cmd_stack(args: argparse.Namespace) -> int:
    # SIGTERM (kill, timeout, a service manager) must stop the stack's processes like Ctrl-C does
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    root = Path(args.root)
    # the workers' warm shutdown kills trainers that have not checkpointed after the grace;
    # wait that long plus time for the worker to write the jobs back and exit
    shutdown_s = get_settings().shutdown_grace_s + 30
    stack = api.stack.Stack(
        root=root,
        api_port=args.port,
        workers=args.workers,
        concurrency=args.concurrency,
        shutdown_s=shutdown_s,
        admin_token=api.stack.kept_admin_token(root),
        # the API shares this machine with the trainers: they yield to it (trainer/priority.py)
        extra_env={
            **_trusted_hosts_env(),
            "SHARDYARD_TRAINER_NICE": os.environ.get("SHARDYARD_TRAINER_NICE", "19"),
        },
    )
    console.print(
        f"starting redis-server, the API on {stack.base_url} and {args.workers} worker(s) running up to "
        f"{args.concurrency} job(s) each at once; logs in {root}/"
    )
    try:
        stack.start()
        _say_started(stack, root)
        if args.demo:
            _submit_demo(stack)
        else:
            console.print("the stack keeps running; press Ctrl-C to stop everything")
        # a process that dies is restarted (with a back-off); only Ctrl-C, SIGTERM or a crash
        # loop end this
        stack.supervise(say=lambda line: err.print(f"[yellow]{line}[/]", highlight=False))
    except api.stack.CrashLoop as e:
        err.print(f"[red]stopping the stack: {e}[/]", highlight=False)
        return 1
    except KeyboardInterrupt:
        pass
    finally:
        console.print(
            f"stopping: running jobs checkpoint and go back to the queue (up to {shutdown_s:.0f}s; "
            "Ctrl-C again to kill them)..."
        )
        stack.stop()
    return 0
