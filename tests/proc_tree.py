"""The processes under some pids, read from /proc (no extra package): what a test kills to play a
machine's death (tests/integration/test_gang.py, tests/slurm/test_slurm_pool.py); and a service
process a test starts in its own session and ends with its whole group (`logged_process`)."""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def logged_process(
    cmd: list[str], *, log: Path, env: dict[str, str] | None = None, stop_s: float = 15
) -> Iterator[subprocess.Popen]:
    """`cmd` in its own session, stdout and stderr appended to `log`; on leaving, its process group
    gets SIGTERM, then SIGKILL when it has not ended within `stop_s`."""
    with log.open("ab") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(stop_s)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def process_tree(root_pids: list[int]) -> list[int]:
    """The processes under `root_pids`, themselves included."""
    children: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(d.name))
    out, todo = [], list(root_pids)
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo += children.get(pid, [])
    return out
