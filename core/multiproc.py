"""Where the processes of one API deployment leave their Prometheus values (core/telemetry.py).

Kept apart from core/telemetry.py because prometheus-client chooses, once, at its own import,
between keeping values in memory and in files: whoever sets PROMETHEUS_MULTIPROC_DIR must do it
before anything imports prometheus_client, so this module must not import it.

The files are memory-mapped and grown as values appear: a write into a page of a file whose disk is
full is not an error the writer could catch but a SIGBUS that kills the process. So they never
live in the data dir (the disk that fills: checkpoints, logs, the SQLite database) but in a runtime
folder in memory (runtime_multiproc_dir), where a full data disk gives 503s from a live API.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import stat
import tempfile
from pathlib import Path

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"


def runtime_base() -> Path:
    """The folder in memory for this user's runtime files: $XDG_RUNTIME_DIR (systemd's per-user
    tmpfs) when set and usable, else /dev/shm, else the temporary folder."""
    for candidate in (os.environ.get("XDG_RUNTIME_DIR"), "/dev/shm"):
        if candidate and os.path.isdir(candidate) and os.access(candidate, os.W_OK | os.X_OK):
            return Path(candidate)
    return Path(tempfile.gettempdir())


def runtime_multiproc_dir(key: str) -> Path:
    """The empty multiprocess folder of the deployment named by `key` (its data dir, and its port
    where several APIs share one): `shardyard-<uid>-<hash of key>` under runtime_base(), mode
    0700, emptied now (fresh_multiproc_dir)."""
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    return fresh_multiproc_dir(runtime_base() / f"shardyard-{os.getuid()}-prometheus-{digest}")


def fresh_multiproc_dir(path: Path) -> Path:
    """An empty folder for the multiprocess files, mode 0700: values of an earlier run's processes
    would otherwise be summed into this run's. In a shared folder such as /dev/shm the name could
    have been taken by another user first (a link, a folder of theirs): that is refused, never
    followed or emptied."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        pass
    else:
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
            raise RuntimeError(
                f"{path} is not a folder of this user's: remove it, or set {MULTIPROC_ENV} to a folder "
                "of your own"
            )
        shutil.rmtree(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.mkdir(mode=0o700)
    os.chmod(path, 0o700)  # whatever the umask
    return path


def remove_multiproc_dir(path: Path) -> None:
    """The deployment stopped: its folder goes (it is in memory)."""
    shutil.rmtree(path, ignore_errors=True)
