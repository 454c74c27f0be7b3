"""The worker's side of the fusion plan's kept step costs (trainer/selection/step_costs.py): this
host's file, outside any sandbox, a copy of it for each group's trainer, and the lines a group's
trainer measured taken back from its summary.

The file lives in the data dir's cache/ folder, named by the host (a data dir several hosts mount
keeps one file per host: a line is a measurement of this machine). The trainer never writes it:
it reads the copy in its group's folder and reports what it measured in its batch_result line,
which the worker checks as it would any input from users' code (bounded, finite, in range;
jobrules/step_costs.py `entry`) and stamps with its own clock. A group whose trainer runs
users' code (a workspace, requirements) keeps its lines in its owner's file only: they steer that
owner's batches, never another's, and a line kept for every owner is read first.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import re
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from core.safe_files import write_fresh
from core.settings import Settings
from jobrules.step_costs import KEY, MAX_REPORTED, dump, entry, newest, read

log = logging.getLogger(__name__)


def host_file(settings: Settings, *, owner: int | None = None, own_code: bool = False) -> Path:
    """This host's file: every owner's lines, or (`own_code`) the lines of `owner`'s groups that
    ran users' code."""
    host = re.sub(r"[^A-Za-z0-9_.-]", "_", socket.gethostname())[:64] or "host"
    scope = f".owner-{owner if owner is not None else 'none'}" if own_code else ""
    return settings.data_dir / "cache" / f"step-costs.{host}{scope}.json"


def hand_over(settings: Settings, dest: Path, *, owner: int | None, own_code: bool) -> None:
    """Write the lines a group may plan with to `dest` (in the group's folder): this host's, and
    for a group that runs users' code its owner's beside them (this host's win)."""
    now = time.time()
    known = read(host_file(settings), now=now)
    if own_code:
        known = newest({**read(host_file(settings, owner=owner, own_code=True), now=now), **known})
    # the group's folder is writable by its batch's sandboxed trainers: written fresh, never through
    # a name one of them may have left there
    write_fresh(dest, dump(known), root=dest.parent)


def reported(summary: Any, *, now: float) -> dict[str, dict[str, float]]:
    """The valid lines of a group's summary (its `fusion.measured`: [{"key", "fixed_s",
    "member_s"}, ...]), stamped `now`; anything else in it is ignored, at most MAX_REPORTED read."""
    fusion = summary.get("fusion") if isinstance(summary, dict) else None
    lines = fusion.get("measured") if isinstance(fusion, dict) else None
    if not isinstance(lines, list):
        return {}
    out: dict[str, dict[str, float]] = {}
    for raw in lines[:MAX_REPORTED]:
        if not isinstance(raw, dict):
            continue
        k = raw.get("key")
        if not isinstance(k, str) or not KEY.fullmatch(k):
            continue
        if (e := entry(raw, now=now, stamped=False)) is not None:
            out[k] = {**e, "at": now}
    return out


def learn(settings: Settings, summary: Any, *, owner: int | None, own_code: bool) -> int:
    """Keep the lines a group's trainer measured (its batch_result's data) in this host's file, or
    its owner's when it ran users' code; returns how many. Never raises for what `summary` holds."""
    now = time.time()
    lines = reported(summary, now=now)
    if not lines:
        return 0
    path = host_file(settings, owner=owner, own_code=own_code)
    path.parent.mkdir(parents=True, exist_ok=True)
    with _locked(path):
        kept = newest({**read(path, now=now), **lines})
        write_fresh(path, dump(kept), root=path.parent)
    return len(lines)


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """The file's lock among this host's worker processes (each merges what it read)."""
    with open(path.with_name(path.name + ".lock"), "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
