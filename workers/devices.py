"""What this worker machine has, for the heartbeat. Asks torch in a subprocess, so the worker's
parent process never initialises CUDA (forked children would inherit a broken CUDA context)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

_PROBE = "import json; from trainer.device import describe_devices; print(json.dumps(describe_devices()))"


def local_devices() -> list[dict[str, object]]:
    try:
        out = subprocess.run(
            [sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=120, check=True
        )
        return json.loads(out.stdout.strip().splitlines()[-1])
    except (subprocess.SubprocessError, ValueError, IndexError):
        return [{"type": "cpu", "index": 0, "name": "cpu", "cores": os.cpu_count()}]


def host_ram_bytes() -> int:
    """Physical memory, or the container's (cgroup v2) limit when that is smaller."""
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    try:
        limit = open("/sys/fs/cgroup/memory.max").read().strip()  # noqa: SIM115 - one read
        if limit.isdigit():
            ram = min(ram, int(limit))
    except OSError:
        pass
    return ram


def host_inventory(*, slots: int = 0, tasks: int = 1) -> dict[str, int]:
    """What the scheduler and the API's admission check compare a job with: host RAM, rank slots
    (`slots`, or 4 per CPU core: gloo ranks of small jobs share cores well) and `tasks`, the jobs
    the worker can run at once (its Celery concurrency)."""
    cpus = os.cpu_count() or 1
    return {"ram_bytes": host_ram_bytes(), "slots": slots or 4 * cpus, "cpus": cpus, "tasks": max(1, tasks)}
