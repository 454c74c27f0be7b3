"""The processes under some pids, read from /proc (no extra package): what a test kills to play a
machine's death (tests/integration/test_gang.py, tests/slurm/test_slurm_pool.py)."""

from __future__ import annotations

from pathlib import Path


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
