"""Refuse at submit a job that no known worker could ever run."""

from __future__ import annotations

from sqlalchemy.orm import Session

from api.schemas import JobSpec
from core.settings import Settings
from db.workers import live_workers


def placement_problem(session: Session, spec: JobSpec, settings: Settings) -> str | None:
    """A reason when live workers exist and none has what the job asks for; None otherwise.
    With no live worker at all the job is accepted and waits (workers may be restarting)."""
    gpus_needed = max(spec.resources.gpus, 1 if spec.resources.device == "cuda" else 0)
    if gpus_needed == 0:
        return None
    workers = live_workers(session, within_s=settings.worker_alive_s)
    if not workers:
        return None
    best = 0
    for w in workers:
        devices = w.devices.get("devices", [])
        has = sum(1 for d in devices if d.get("type") == "cuda")
        if "gpu" in w.queues.get("queues", []):
            best = max(best, has)
    if best < gpus_needed:
        return (
            f"resources.gpus ({gpus_needed}) cannot be met: the largest GPU worker alive has {best} "
            f"GPU(s) ({len(workers)} worker(s) alive); set resources.device to 'cpu' or 'auto' with gpus 0"
        )
    return None
