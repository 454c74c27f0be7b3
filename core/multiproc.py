"""Where the processes of one API deployment leave their Prometheus values (core/telemetry.py).

Kept apart from core/telemetry.py because prometheus-client chooses, once, at its own import,
between keeping values in memory and in files: whoever sets PROMETHEUS_MULTIPROC_DIR must do it
before anything imports prometheus_client, so this module must not import it.
"""

from __future__ import annotations

import shutil
from pathlib import Path

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"


def fresh_multiproc_dir(path: Path) -> Path:
    """An empty folder for the multiprocess files: values of an earlier run's processes would
    otherwise be summed into this run's."""
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)
    return path
