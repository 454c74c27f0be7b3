"""Table rows to public schemas."""

from __future__ import annotations

from api.schemas import EventPublic, JobPublic, Progress
from db.jobs import aware
from db.models import Job, JobEvent


def job_public(job: Job) -> JobPublic:
    return JobPublic(
        id=job.id,
        name=job.name,
        kind=job.kind,
        status=job.status,
        priority=job.priority,
        queue=job.queue,
        world_size=job.world_size,
        attempts=job.attempts,
        created_at=aware(job.created_at),
        started_at=aware(job.started_at),
        finished_at=aware(job.finished_at),
        worker=job.worker,
        error=job.error,
        result=job.result,
        spec=job.spec,
        cancel_requested=job.cancel_requested,
        progress=Progress(step=job.step, steps=job.steps),
        selection_id=job.selection_id,
    )


def event_public(ev: JobEvent) -> EventPublic:
    return EventPublic(id=ev.id, time=ev.time, kind=ev.kind, message=ev.message, data=ev.data)
