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
