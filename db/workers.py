"""Workers' heartbeats: each worker's inventory (queues, devices, host), its warm shutdown, and
which workers are alive.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from db.jobs import aware
from db.models import WorkerBeat, utcnow


def record_heartbeat(
    session: Session,
    *,
    name: str,
    hostname: str,
    queues: list[str],
    devices: list[dict[str, Any]],
    host: dict[str, int] | None = None,
    sandbox: dict[str, Any] | None = None,
) -> None:
    """`host` is the machine's inventory for admission ({ram_bytes, slots, cpus}); `sandbox` the
    state of its trainers' sandbox ({sandbox: on | off | unavailable, why})."""
    inventory: dict[str, Any] = {"devices": devices, "host": host or {}}
    if sandbox is not None:
        inventory["sandbox"] = sandbox
    beat = session.get(WorkerBeat, name)
    if beat is None:
        session.add(WorkerBeat(name=name, hostname=hostname, queues={"queues": queues}, devices=inventory))
    else:
        beat.last_seen = utcnow()
        beat.queues = {"queues": queues}
        beat.devices = inventory
    session.commit()


def mark_draining(session: Session, *, name: str) -> None:
    """The worker is shutting down warm: its inventory says so, and the scheduler places nothing
    more on it (its heartbeat stops soon after)."""
    beat = session.get(WorkerBeat, name)
    if beat is not None:
        inventory = dict(beat.devices or {})
        inventory["host"] = {**(inventory.get("host") or {}), "draining": 1}
        beat.devices = inventory
        session.commit()


def live_workers(session: Session, *, within_s: float) -> list[WorkerBeat]:
    cutoff = utcnow() - timedelta(seconds=within_s)
    return [w for w in session.scalars(select(WorkerBeat)).all() if aware(w.last_seen) >= cutoff]
