"""The per-job metric series cache behind GET /api/jobs/{id}/metrics.

A running job has tens of thousands of points, and every read of its chart used to fetch them all
and turn them into arrays again (bench/api_load.py: the route's p95 was 68-208 ms under load). Each
API process keeps the series of the jobs it was asked for as arrays and, on each request, reads
only the points stored since (`id` above the highest it holds), so a read costs the new points.

Exact, not a time-to-live: every request reads what is new, so a point is in the answer from the
first request after its commit. Ids arrive in commit order per job: one relay batch at a time
writes a job's points (db/jobs.py apply_lines, fenced by `applied_seq`; of a gang only the node of
global rank 0 writes any). A point is only ever rewritten in place (same id, new value) when
an attempt re-runs steps from a checkpoint, and each attempt (`Job.attempts`) starts from a full
read; so does a new job under a reused id (`created_at`), a point that arrives out of step order
(an in-place rewrite cannot be seen, so the series is read again) and an entry older than
FULL_READ_S, which bounds what any missed case could cost.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime

import numpy as np
from sqlalchemy.orm import Session

from api.downsample import downsample_arrays
from db import ingest as db_ingest
from db.models import Job

CACHED_JOBS = 32
"""Jobs whose series one API process keeps (least recently read dropped first)."""
FULL_READ_S = 60.0
"""An entry is read in full again after this long, whatever happened."""


@dataclass(slots=True)
class _Entry:
    version: tuple[datetime | None, int]
    read_at: float
    last_id: int = 0
    series: dict[str, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)


_CACHE: OrderedDict[tuple[str, int], _Entry] = OrderedDict()
_CACHE_LOCK = threading.Lock()


def _group(rows: Sequence[tuple[int, str, int, float]]) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Rows ordered by (name, step) as one (steps, values) pair of arrays per name."""
    out: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    if not rows:
        return out
    names = [r[1] for r in rows]
    steps = np.fromiter((r[2] for r in rows), dtype=np.int64, count=len(rows))
    values = np.fromiter((r[3] for r in rows), dtype=np.float64, count=len(rows))
    start = 0
    for i in range(1, len(rows) + 1):
        if i == len(rows) or names[i] != names[start]:
            out[names[start]] = (steps[start:i].copy(), values[start:i].copy())
            start = i
    return out


def _full(session: Session, entry: _Entry, job_id: int) -> None:
    rows = db_ingest.metric_rows(session, job_id=job_id)
    entry.series = _group(rows)
    entry.last_id = max((r[0] for r in rows), default=0)
    entry.read_at = time.monotonic()


def _extend(session: Session, entry: _Entry, job_id: int) -> bool:
    """Append the points stored since; False when one does not follow its series' last step."""
    rows = db_ingest.metric_rows(session, job_id=job_id, after_id=entry.last_id)
    if not rows:
        return True
    new = _group(rows)
    for name, (steps, _) in new.items():
        held = entry.series.get(name)
        if held is not None and len(held[0]) and steps[0] <= held[0][-1]:
            return False
    for name, (steps, values) in new.items():
        held = entry.series.get(name)
        entry.series[name] = (
            (steps, values)
            if held is None
            else (np.concatenate([held[0], steps]), np.concatenate([held[1], values]))
        )
    entry.last_id = max(entry.last_id, max(r[0] for r in rows))
    return True


def _entry(database_url: str, job: Job) -> tuple[_Entry, bool]:
    """The job's entry (a fresh one when its version changed), and whether it is new."""
    key = (database_url, job.id)
    version = (job.created_at, job.attempts or 0)
    with _CACHE_LOCK:
        entry = _CACHE.get(key)
        if entry is not None and entry.version == version:
            _CACHE.move_to_end(key)
            return entry, False
        entry = _Entry(version=version, read_at=0.0)
        _CACHE[key] = entry
        _CACHE.move_to_end(key)
        while len(_CACHE) > CACHED_JOBS:
            _CACHE.popitem(last=False)
        return entry, True


def job_series(
    session: Session,
    *,
    database_url: str,
    job: Job,
    names: list[str] | None,
    since_step: int,
    max_points: int | None,
) -> dict[str, tuple[list[int], list[float]]]:
    """Each wanted series of `job` from `since_step` on, downsampled to `max_points` (all of them
    when None), as the route answers it."""
    entry, fresh = _entry(database_url, job)
    with entry.lock:
        if fresh or time.monotonic() - entry.read_at > FULL_READ_S or not _extend(session, entry, job.id):
            _full(session, entry, job.id)
        wanted = entry.series if names is None else {n: entry.series[n] for n in names if n in entry.series}
        out = {}
        for name, (steps, values) in wanted.items():
            first = int(np.searchsorted(steps, since_step)) if since_step else 0
            if first >= len(steps):
                continue
            out[name] = downsample_arrays(steps[first:], values[first:], max_points=max_points or len(steps))
        return out


def clear() -> None:
    """Forget every entry (tests)."""
    with _CACHE_LOCK:
        _CACHE.clear()
