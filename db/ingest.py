"""The trainer's metrics and events: one job's lines of a relay batch applied, fenced by its
attempt (apply_lines), and read back for the API's charts and streams.
"""

from __future__ import annotations

import itertools
import operator
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any, cast

from sqlalchemy import case, delete, func, insert, select, update
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.orm import Session

from db.connection import AnyRow
from db.jobs import Attempt, attempt_fence
from db.models import Job, JobEvent, MetricPoint, MetricSummary


@dataclass(slots=True)
class JobLines:
    """One job's share of a relay batch, each line with its protocol sequence number."""

    metrics: list[tuple[int | None, int, str, float, float]] = field(default_factory=list)
    """(seq, step, name, value, time)"""
    events: list[tuple[int | None, str, str, dict[str, Any] | None, float]] = field(default_factory=list)
    """(seq, kind, message, data, time); kind is log or event; seq None for a stray text line"""
    result: tuple[int | None, dict[str, Any]] | None = None
    """(seq, data)"""

    def empty(self) -> bool:
        return not (self.metrics or self.events or self.result)


@dataclass(slots=True)
class Applied:
    """What one batch wrote for one job: rows with their ids, for the live channels."""

    metrics: list[dict[str, Any]] = field(default_factory=list)
    events: list[dict[str, Any]] = field(default_factory=list)
    result: dict[str, Any] | None = None
    applied_step: int | None = None
    """The job's applied_step after the batch (the newest checkpoint a resume may use): the
    relay writes it into the checkpoint folder for the trainer's pruning (jobrules/applied.py)."""


def _upsert_points(session: Session, rows: list[dict[str, Any]]) -> dict[tuple[str, int], int]:
    """Insert-or-update on (job, name, step); returns each row's id by (name, step)."""
    dialect = session.get_bind().dialect.name
    ins = (sqlite_insert if dialect == "sqlite" else pg_insert)(MetricPoint)
    stmt = ins.on_conflict_do_update(
        index_elements=["job_id", "name", "step"],
        set_={"value": ins.excluded.value, "time": ins.excluded.time},
    ).returning(MetricPoint.id, MetricPoint.name, MetricPoint.step)
    return {(n, st): i for i, n, st in session.execute(stmt, rows)}


def apply_lines(
    session: Session,
    *,
    attempt: Attempt,
    lines: JobLines,
    lease_s: float,
    now: datetime,
    fence: Any = None,
    renew: bool = True,
    run_seconds: float | None = None,
) -> Applied | None:
    """Apply one job's lines of a batch inside the caller's transaction and renew its lease (and
    record `run_seconds`, the job's run time over all its attempts, when given).
    None when the attempt is fenced off (re-queued, failed by an operator, taken by a newer
    attempt): then nothing of it is written. Lines at or below the applied sequence number are
    skipped, so a batch retried after a commit that did go through changes nothing. `fence` (the
    job owner's by default) and `renew` (the job's lease) are for a gang's nodes (apply_gang_lines)."""
    fence = attempt_fence(attempt) if fence is None else fence
    seen = session.scalar(select(Job.applied_seq).where(fence))
    if seen is None:
        return None
    out = Applied()

    def fresh(seq: int | None) -> bool:  # lines with no number always apply
        return seq is None or seq > seen

    metrics = [m for m in lines.metrics if fresh(m[0])]
    events = [e for e in lines.events if fresh(e[0])]
    result = lines.result if lines.result and fresh(lines.result[0]) else None
    numbered = [m[0] for m in metrics] + [e[0] for e in events] + ([result[0]] if result else [])
    seqs = [seq for seq in numbered if seq is not None]
    top_seq = max([seen, *seqs])
    ckpts: list[int] = []
    values: dict[str, Any] = {"applied_seq": top_seq}
    if renew:
        values["lease_until"] = now + timedelta(seconds=lease_s)
    if run_seconds is not None:
        values["run_seconds"] = run_seconds
    if metrics:
        latest = {(n, st): (st, n, v, t) for _, st, n, v, t in metrics}  # one row per key per statement
        rows: list[dict[str, Any]] = [
            {"job_id": attempt.job_id, "step": st, "name": n, "value": v, "time": t}
            for st, n, v, t in latest.values()
        ]
        ids = _upsert_points(session, rows)
        out.metrics = [{"id": ids[(r["name"], r["step"])], **r} for r in rows]
        top = max(st for st, *_ in latest.values())
        values["step"] = case((Job.step < top, top), else_=Job.step)
        if losses := [(st, v) for st, n, v, _ in latest.values() if n == "loss"]:
            values["last_loss"] = max(losses)[1]
    if events:
        rows = [
            {"job_id": attempt.job_id, "time": t, "kind": k, "message": m, "data": d}
            for _, k, m, d, t in events
        ]
        event_ids = session.scalars(
            insert(JobEvent).returning(JobEvent.id, sort_by_parameter_order=True), rows
        ).all()
        out.events = [{"id": i, **r} for i, r in zip(event_ids, rows, strict=True)]
        ckpts += [
            d["step"]
            for _, k, m, d, _ in events
            if k == "event" and m == "checkpoint" and d and isinstance(d.get("step"), int)
        ]
    if result is not None:
        values["result"] = out.result = result[1]
        if isinstance(result[1].get("steps"), int):
            ckpts.append(result[1]["steps"])
    if ckpts:
        values["applied_step"] = case((Job.applied_step < max(ckpts), max(ckpts)), else_=Job.applied_step)
    row = session.execute(
        update(Job).where(fence, Job.applied_seq == seen).values(**values).returning(Job.applied_step)
    ).first()
    if row is None:
        return None
    out.applied_step = row[0]
    return out


def add_event(
    session: Session,
    *,
    job_id: int,
    kind: str,
    message: str,
    data: dict[str, Any] | None = None,
    at: float | None = None,
) -> int:
    ev = JobEvent(job_id=job_id, time=at or time.time(), kind=kind, message=message, data=data)
    session.add(ev)
    session.commit()
    return ev.id


def metric_series(
    session: Session, *, job_id: int, names: Sequence[str] | None = None, since_step: int = 0
) -> dict[str, tuple[list[int], list[float]]]:
    q = select(MetricPoint.name, MetricPoint.step, MetricPoint.value).where(
        MetricPoint.job_id == job_id, MetricPoint.step >= since_step
    )
    if names:
        q = q.where(MetricPoint.name.in_(list(names)))
    # the driver's own tuples (name, step and value need no conversion on SQLite or Postgres),
    # grouped by name in bulk: a long job has tens of thousands of points, and making an ORM row
    # of each held the API's interpreter lock for a large share of every read (bench/api_load.py)
    result = session.connection().execute(q.order_by(MetricPoint.name, MetricPoint.step, MetricPoint.id))
    try:
        rows = result.cursor.fetchall()
    finally:
        result.close()
    out: dict[str, tuple[list[int], list[float]]] = {}
    for name, group in itertools.groupby(rows, key=operator.itemgetter(0)):
        points = list(group)
        steps, values = out.setdefault(name, ([], []))  # (a name comes in one run: ordered by it)
        steps += [p[1] for p in points]
        values += [p[2] for p in points]
    return out


def metric_rows(session: Session, *, job_id: int, after_id: int = 0) -> list[tuple[int, str, int, float]]:
    """(id, name, step, value) of a job's points with an id above `after_id`, ordered by name and
    step, as the driver's tuples: what the API's per-job series cache reads (api/series.py)."""
    q = (
        select(MetricPoint.id, MetricPoint.name, MetricPoint.step, MetricPoint.value)
        .where(MetricPoint.job_id == job_id, MetricPoint.id > after_id)
        .order_by(MetricPoint.name, MetricPoint.step, MetricPoint.id)
    )
    result = session.connection().execute(q)
    try:
        return cast("list[tuple[int, str, int, float]]", result.cursor.fetchall())
    finally:
        result.close()


def metric_summaries(session: Session, *, job_id: int, attempt: int) -> list[MetricSummary]:
    """The job's stored series summaries of attempt `attempt` (none when they stand for another)."""
    rows = session.scalars(select(MetricSummary).where(MetricSummary.job_id == job_id)).all()
    return [r for r in rows if r.attempt == attempt]


@dataclass(frozen=True, slots=True)
class SummaryIn:
    """One series' summary to store: its steps (int64) and values (float64) as little-endian bytes."""

    name: str
    points: int
    steps: bytes
    values: bytes


def write_summaries(
    session: Session, *, job_id: int, attempt: int, upto_id: int, series: Sequence[SummaryIn]
) -> None:
    """Replace the job's series summaries with `series` (covering its points up to `upto_id`);
    commits. A job deleted meanwhile gets none."""
    session.execute(delete(MetricSummary).where(MetricSummary.job_id == job_id))
    if series and session.get(Job, job_id) is not None:
        session.add_all(
            MetricSummary(
                job_id=job_id,
                name=s.name,
                attempt=attempt,
                upto_id=upto_id,
                points=s.points,
                steps=s.steps,
                values=s.values,
            )
            for s in series
        )
    session.commit()


def series_of_jobs(
    session: Session, *, job_ids: Sequence[int], name: str
) -> dict[int, tuple[list[int], list[float]]]:
    """One metric's (steps, values) of each of `job_ids` (a selection batch's trials) in one
    query, step order, by job id: a seek per job down the (job_id, name, step) index."""
    out: dict[int, tuple[list[int], list[float]]] = {}
    for k in range(0, len(job_ids), 1000):  # well under SQLite's bound on a statement's parameters
        q = (
            select(MetricPoint.job_id, MetricPoint.step, MetricPoint.value)
            .where(MetricPoint.job_id.in_(list(job_ids[k : k + 1000])), MetricPoint.name == name)
            .order_by(MetricPoint.job_id, MetricPoint.step)
        )
        result = session.connection().execute(q)
        try:
            rows = result.cursor.fetchall()
        finally:
            result.close()
        for job_id, group in itertools.groupby(rows, key=operator.itemgetter(0)):
            points = list(group)
            out[job_id] = ([p[1] for p in points], [p[2] for p in points])
    return out


def metrics_after(
    session: Session, *, job_id: int, after_id: int, upto_id: int | None = None, limit: int = 5000
) -> Sequence[AnyRow]:
    """The job's metric points after `after_id` (and up to `upto_id`, when given), as plain rows
    (id, step, name, value, time): a stream that fell behind reads thousands of them, and ORM
    objects cost several times the CPU of the rows (bench/api_load.py's stalls were streams'
    replays building them)."""
    q = select(MetricPoint.id, MetricPoint.step, MetricPoint.name, MetricPoint.value, MetricPoint.time).where(
        MetricPoint.job_id == job_id, MetricPoint.id > after_id
    )
    if upto_id is not None:
        q = q.where(MetricPoint.id <= upto_id)
    return session.execute(q.order_by(MetricPoint.id).limit(limit)).all()


def newest_metric_id(session: Session, *, job_id: int) -> int:
    """The id of the job's newest metric point (0 when none): one step down its index."""
    return session.scalar(select(func.max(MetricPoint.id)).where(MetricPoint.job_id == job_id)) or 0


def newest_event_id(session: Session, *, job_id: int) -> int:
    """The id of the job's newest event (0 when none): one step down its (job_id, id) index."""
    return session.scalar(select(func.max(JobEvent.id)).where(JobEvent.job_id == job_id)) or 0


def events_after(
    session: Session,
    *,
    job_id: int,
    after_id: int = 0,
    kinds: Sequence[str] | None = None,
    limit: int = 5000,
) -> Sequence[JobEvent]:
    q = select(JobEvent).where(JobEvent.job_id == job_id, JobEvent.id > after_id)
    if kinds:
        q = q.where(JobEvent.kind.in_(list(kinds)))
    return session.scalars(q.order_by(JobEvent.id).limit(limit)).all()


def last_status_event(session: Session, *, job_id: int) -> JobEvent | None:
    q = (
        select(JobEvent)
        .where(JobEvent.job_id == job_id, JobEvent.kind == "status")
        .order_by(JobEvent.id.desc())
        .limit(1)
    )
    return session.scalars(q).first()


def latest_event(session: Session, *, job_id: int, message: str) -> JobEvent | None:
    q = (
        select(JobEvent)
        .where(JobEvent.job_id == job_id, JobEvent.kind == "event", JobEvent.message == message)
        .order_by(JobEvent.id.desc())
        .limit(1)
    )
    return session.scalars(q).first()
