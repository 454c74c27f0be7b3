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

A job with a series of SUMMARY_MIN_POINTS or more (a million-point run) has its series stored
downsampled after its first full read (db MetricSummary, one per series, for the job's current
attempt): a later first read, in any API process, reads those and the points stored after them,
not every point (bench/scale.py: 2.9 s for a million points on SQLite). What such an entry
answers is downsampled from the summary and the newer points (LTTB of an LTTB, which draws the
same at a chart's width); an answer of more than SUMMARY_POINTS / 2 points per series, or of
every point, reads every point instead.
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

from api.downsample import downsample, downsample_arrays
from db import ingest as db_ingest
from db.models import Job

SUMMARY_MIN_POINTS = 100_000
"""A job with a series this long gets its series stored downsampled (db MetricSummary) after
its first full read: a later first read (another API process, a restart, an entry pushed out)
reads those and the points stored since, not a million points."""
SUMMARY_POINTS = 10_000
"""Points a stored summary keeps of a long series (LTTB). An answer of more than half as many
points per series reads every point instead."""
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
    summarized: bool = False
    """Some series are held downsampled (read from stored summaries), not point for point."""
    points: dict[str, int] = field(default_factory=dict)
    """Points of each series stored in the database that the held arrays stand for."""


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


def _full(session: Session, entry: _Entry, job: Job) -> None:
    """Every point of the job; a job with a long series gets its series stored summarized."""
    rows = db_ingest.metric_rows(session, job_id=job.id)
    entry.series = _group(rows)
    entry.points = {name: len(steps) for name, (steps, _) in entry.series.items()}
    entry.summarized = False
    entry.last_id = max((r[0] for r in rows), default=0)
    entry.read_at = time.monotonic()
    if any(n >= SUMMARY_MIN_POINTS for n in entry.points.values()):
        _store_summaries(session, entry, job)


def _store_summaries(session: Session, entry: _Entry, job: Job) -> None:
    """Every series of the job as held (a long one downsampled to SUMMARY_POINTS), up to the
    entry's newest point: a summary must stand for all of a job's series, since a read from
    summaries reads only the points stored after them."""
    out = []
    for name, (steps, values) in entry.series.items():
        kept_steps, kept_values = (
            downsample_arrays(steps, values, max_points=SUMMARY_POINTS)
            if len(steps) > SUMMARY_POINTS
            else (steps, values)
        )
        out.append(
            db_ingest.SummaryIn(
                name=name,
                points=entry.points.get(name, len(steps)),
                steps=np.asarray(kept_steps, dtype="<i8").tobytes(),
                values=np.asarray(kept_values, dtype="<f8").tobytes(),
            )
        )
    db_ingest.write_summaries(
        session, job_id=job.id, attempt=job.attempts or 0, upto_id=entry.last_id, series=out
    )


def _from_summaries(session: Session, entry: _Entry, job: Job) -> bool:
    """The job's stored summaries (of its current attempt) and the points stored since; False
    when it has none, or a newer point does not follow its series (then read everything)."""
    stored = db_ingest.metric_summaries(session, job_id=job.id, attempt=job.attempts or 0)
    if not stored or len({r.upto_id for r in stored}) != 1:
        return False
    entry.series = {
        r.name: (np.frombuffer(r.steps, dtype="<i8").copy(), np.frombuffer(r.values, dtype="<f8").copy())
        for r in stored
    }
    entry.points = {r.name: r.points for r in stored}
    entry.summarized = any(r.points > len(entry.series[r.name][0]) for r in stored)
    entry.last_id = stored[0].upto_id
    entry.read_at = time.monotonic()
    held = sum(len(steps) for steps, _ in entry.series.values())
    if not _extend(session, entry, job.id):
        return False
    if sum(len(steps) for steps, _ in entry.series.values()) - held > SUMMARY_POINTS:
        _store_summaries(session, entry, job)  # many points since: the next reader starts later
    return True


def _extend(session: Session, entry: _Entry, job_id: int) -> bool:
    """Append the points stored since; False when one does not follow its series' last step."""
    rows = db_ingest.metric_rows(session, job_id=job_id, after_id=entry.last_id)
    if not rows:
        return True
    new = _group(rows)
    for name, (steps, _) in new.items():
        entry.points[name] = entry.points.get(name, 0) + len(steps)
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
            if not _from_summaries(session, entry, job):
                _full(session, entry, job)
        if entry.summarized and (max_points is None or max_points > SUMMARY_POINTS // 2):
            return _exact(session, job=job, names=names, since_step=since_step, max_points=max_points)
        wanted = entry.series if names is None else {n: entry.series[n] for n in names if n in entry.series}
        out = {}
        for name, (steps, values) in wanted.items():
            first = int(np.searchsorted(steps, since_step)) if since_step else 0
            if first >= len(steps):
                continue
            out[name] = downsample_arrays(steps[first:], values[first:], max_points=max_points or len(steps))
        return out


def _exact(
    session: Session, *, job: Job, names: list[str] | None, since_step: int, max_points: int | None
) -> dict[str, tuple[list[int], list[float]]]:
    """Every point read (past the cache): an answer finer than a stored summary keeps."""
    raw = db_ingest.metric_series(session, job_id=job.id, names=names, since_step=since_step)
    return {
        name: downsample(steps, values, max_points=max_points or len(steps))
        for name, (steps, values) in raw.items()
    }


def clear() -> None:
    """Forget every entry (tests)."""
    with _CACHE_LOCK:
        _CACHE.clear()
