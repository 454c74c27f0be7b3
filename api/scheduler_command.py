"""`shardyard scheduler`: the scheduler on its own (core/scheduler.py). One of these, or the API
processes' embedded ones, is active at a time (a database lock); set
SHARDYARD_EMBEDDED_SCHEDULER=0 on the API when this runs instead. A module apart from
api/server_commands.py because it imports prometheus_client, which `serve` must not."""

from __future__ import annotations

import argparse
import logging
import signal

from prometheus_client import REGISTRY, start_http_server

from api.server_commands import cmd_migrate
from core.scheduler_loop import Scheduler
from core.settings import get_settings
from core.telemetry import multiprocess, multiprocess_registry
from core.webhooks import Deliverer


def cmd_scheduler(args: argparse.Namespace) -> int:
    cmd_migrate(args)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    if args.metrics_port:
        # no API process beside it to serve these: its own /metrics on the given port
        registry = multiprocess_registry() if multiprocess() else REGISTRY
        start_http_server(args.metrics_port, addr=args.metrics_host, registry=registry)
    sched = Scheduler(get_settings())
    deliverer = Deliverer(get_settings()).start()
    signal.signal(signal.SIGTERM, lambda *_: sched.stop_event.set())
    try:
        sched.run()
    except KeyboardInterrupt:
        pass
    finally:
        deliverer.stop()
    return 0
