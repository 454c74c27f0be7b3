"""`shardyard stack` as the user runs it: a real process of its own, and how to stop it and find
what it left behind (tests/integration/test_stack_shutdown.py, test_stack_supervisor.py)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx


def start_stack_cli(
    root: Path, port: int, log: Path, *, env: dict[str, str] | None = None
) -> tuple[subprocess.Popen[bytes], dict[str, str]]:
    """The stack, and the headers that sign in with the admin token it printed. `env`: more
    environment for it (and so for every process it starts)."""
    log.unlink(missing_ok=True)
    with log.open("ab") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "api.cli", "stack", "--root", str(root), "--port", str(port)],
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, "COLUMNS": "200", **(env or {})},
            start_new_session=True,
        )
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        assert proc.poll() is None, log.read_text()[-3000:]
        lines = log.read_text().splitlines()
        token = next((ln.strip() for ln in lines if ln.strip().startswith("sy_")), None)
        try:
            headers = {"Authorization": f"Bearer {token}"}
            if (
                token
                and httpx.get(f"http://127.0.0.1:{port}/api/health", timeout=2, headers=headers).json()[
                    "workers"
                ]
            ):
                return proc, headers
        except (httpx.HTTPError, ValueError, KeyError):
            pass
        time.sleep(0.5)
    raise AssertionError(f"the stack did not come up: {log.read_text()[-3000:]}")


def proc_info(pid: int | str) -> tuple[str, str, str, int]:
    """(command line, working folder, state letter, parent pid) from /proc; OSError when gone."""
    cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    cwd = os.readlink(f"/proc/{pid}/cwd")
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return cmd, cwd, fields[0], int(fields[1])


def left_behind(root: Path) -> list[str]:
    """Processes of this stack still alive: redis-server, uvicorn, Celery and trainers all run
    with the root as their folder or name it on their command line (read from /proc)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmd, cwd, state, _ = proc_info(pid)
        except OSError:
            continue  # gone meanwhile, or not ours to read
        if state != "Z" and (cwd == str(root) or str(root) in cmd):
            found.append(f"{pid}: {cmd[:200]}")
    return found


def sigterm_and_wait(proc: subprocess.Popen[bytes], root: Path) -> int:
    proc.send_signal(signal.SIGTERM)
    rc = proc.wait(timeout=300)
    deadline = time.monotonic() + 10  # children reaped by now; give the kernel a moment
    while left_behind(root) and time.monotonic() < deadline:
        time.sleep(0.2)
    return rc
