"""`shardyard`: submit and watch jobs and selection batches over the REST API (through the Python
SDK, shardyard/client.py), and run the service's processes.

    shardyard submit spec.json [--follow] [--workspace DIR]     shardyard jobs [--status running]
    shardyard show ID    shardyard cancel ID    shardyard logs ID    shardyard follow ID
    shardyard selection submit FILE|- [--follow]    shardyard selection show ID [--json]
    shardyard selection list [--status running] [--name NAME] [--json]
    shardyard selection follow ID    shardyard selection cancel ID
    shardyard serve      shardyard worker       shardyard stack [--demo]    shardyard migrate
    shardyard scheduler [--metrics-port 9101]    shardyard healthcheck
    shardyard admin create-user NAME [--admin]

The API address comes from --api or SHARDYARD_API_URL (default http://127.0.0.1:8000), the API
token from --token or SHARDYARD_TOKEN.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable

from shardyard import cli

# `shardyard` is the SDK's user CLI (shardyard/cli.py, a client of the REST API like any other)
# with the server's own commands after it. Those load the database, Celery and uvicorn (seconds of
# imports a user's `shardyard jobs` never needs), so each is named here by where it lives and
# imported when it runs, the way a console entry point names its function

STACK_CONCURRENCY = 4
"""Jobs each worker of `shardyard stack` runs at once: the demo job (600 steps, minutes on a laptop)
must not hold the only task while a new user's first job waits behind it."""


def server_command(ref: str) -> Callable[[argparse.Namespace], int]:
    """The command at `ref` ("module:function"), its module imported when the command runs."""
    module, _, name = ref.partition(":")

    def run(args: argparse.Namespace) -> int:
        command: Callable[[argparse.Namespace], int] = getattr(importlib.import_module(module), name)
        return command(args)

    return run


def add_server_commands(sub: cli.Commands) -> None:
    """`shardyard migrate|serve|worker|scheduler|healthcheck|admin|stack`."""
    p = sub.add_parser("migrate", help="bring the database to the latest migration")
    p.set_defaults(fn=server_command("api.server_commands:cmd_migrate"))
    p = sub.add_parser("serve", help="run the API (migrates first)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.set_defaults(fn=server_command("api.server_commands:cmd_serve"))
    p = sub.add_parser("worker", help="run a Celery worker (migrates first)")
    p.add_argument("--queues", default="cpu,gpu")
    p.add_argument("--concurrency", type=int, default=1)
    p.set_defaults(fn=server_command("api.server_commands:cmd_worker"))
    p = sub.add_parser("scheduler", help="run the scheduler standalone (migrates first)")
    p.add_argument(
        "--metrics-port", type=int, default=0, help="serve this process's Prometheus metrics on this port"
    )
    p.add_argument("--metrics-host", default="127.0.0.1")
    p.set_defaults(fn=server_command("api.scheduler_command:cmd_scheduler"))
    p = sub.add_parser("healthcheck", help="exit 0 when this container's API, worker or scheduler is healthy")
    p.set_defaults(fn=server_command("api.server_commands:cmd_healthcheck"))
    p = sub.add_parser("admin", help="administration straight on the database")
    admin = p.add_subparsers(dest="admin_command", required=True)
    p = admin.add_parser("create-user", help="create a user and print its first API token")
    p.add_argument("name")
    p.add_argument("--admin", action="store_true", help="may see and act on everyone's jobs")
    p.set_defaults(fn=server_command("api.server_commands:cmd_admin_create_user"))
    p = sub.add_parser("stack", help="run redis-server, the API and a worker on this machine")
    p.add_argument("--root", default=".shardyard")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--workers", type=int, default=1)
    p.add_argument(
        "--concurrency",
        type=int,
        default=STACK_CONCURRENCY,
        help=f"jobs each worker runs at once (default {STACK_CONCURRENCY}: a job of yours starts beside the demo's)",
    )
    p.add_argument("--demo", action="store_true", help="submit the demo job and follow it")
    p.set_defaults(fn=server_command("api.server_commands:cmd_stack"))


def build_parser() -> argparse.ArgumentParser:
    return cli.build_parser(description=__doc__, more=add_server_commands)


def main(argv: list[str] | None = None) -> int:
    return cli.run(build_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
