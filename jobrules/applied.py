"""The applied-step file: how the worker tells the trainer which checkpoint the database has applied.

A job's `applied_step` (db/ingest.py apply_lines) is the newest checkpoint whose metric lines are
all in the database; a resume never goes past it (workers/execute.py drop_checkpoints_past). The
trainer prunes its checkpoints (trainer/checkpoint.py prune_checkpoints) and must never remove the
newest one at or below that step, or an attempt that dies while the relay lags behind it has
nothing to resume from. The trainer stays pure PyTorch, so the step reaches it as a plain file,
`applied-step` in the checkpoint folder, holding the step as decimal text: the worker writes it
when an attempt starts and its relay rewrites it after each commit that moved the step, atomically
(a temporary file renamed over it), so a reader sees the old number or the new one, never a part.

The file may lag the database (it is written after the commit), never lead it: every step it names
is one a resume may use.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path

APPLIED_FILE = "applied-step"


def write_applied_step(directory: Path, step: int, *, create: bool = False) -> bool:
    """Write `step` as `directory`'s applied step, atomically. `create` makes the folder; without
    it a folder that is gone (a trial whose checkpoints were removed) is left gone: False."""
    if create:
        directory.mkdir(parents=True, exist_ok=True)
    elif not directory.is_dir():
        return False
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{APPLIED_FILE}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(f"{int(step)}\n")
        os.replace(tmp, directory / APPLIED_FILE)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return True


def read_applied_step(path: Path) -> int | None:
    """The step in the applied-step file at `path`; None when there is none (a trainer run
    without a worker) or it does not hold a number."""
    try:
        text = path.read_text()
    except OSError:
        return None
    try:
        return int(text.strip())
    except ValueError:
        return None


def kept_steps(steps: list[int], *, keep: int, applied: int | None) -> set[int]:
    """The steps pruning leaves of `steps`: the newest `keep` (0: all) and, with an `applied` step,
    every one from the newest at or below it on (all of them while none is at or below it: the
    database applies checkpoints in the order they were written).

    Not only the one at the applied step: the ranks of a pipeline or tensor layout prune their
    pieces each on its own and read the applied-step file at slightly different moments, so they
    can name different steps; keeping everything from each one's step on leaves every piece of
    the higher of those, a step a resume may use whole. While the relay keeps up this is the
    newest `keep` alone; while it lags, what it has not applied yet stays."""
    ordered = sorted(steps)
    if keep <= 0:
        return set(ordered)
    kept = set(ordered[-keep:])
    if applied is not None:
        at_or_below = [s for s in ordered if s <= applied]
        floor = at_or_below[-1] if at_or_below else None
        kept.update(s for s in ordered if floor is None or s >= floor)
    return kept
