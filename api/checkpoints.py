"""A job's trained weights for download (`GET /api/jobs/{id}/checkpoint`): the newest whole
checkpoint the store holds for it (core/storage.py: the data dir, a folder, or S3).

Where a job's checkpoints are: a plain job's under jobs/<id>/checkpoints/step-<n>.pt, a selection
trial's under selections/<batch>/trial-<index>/step-<n>.pt (a trial's job id is in the batch's
`trials` and its `leaderboard`, so the best trial's weights come from the same route). A job whose
checkpoints are written in pieces (one per pipeline stage and tensor rank) has no whole one to
serve. The file is the trainer's own checkpoint: a zip that `torch.load(path, weights_only=True)`
reads, holding the model's tensors under "model" (a parameter name -> tensor mapping), the
optimizer's state, and the loop's ("loop": the last loss, val_loss and the run's result).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass

from pydantic import BaseModel
from sqlalchemy import select
from sqlalchemy.orm import Session

from core.settings import Settings
from core.storage import checkpoints_prefix, get_storage, selection_prefix
from db.models import Job, Selection, Trial
from jobrules.parallel import checkpoint_pieces

_STEP_FILE = re.compile(r"^step-(\d+)\.pt$")
CHUNK = 1 << 20


class CheckpointPublic(BaseModel):
    """What `GET /api/jobs/{id}/checkpoint` would send now."""

    job_id: int
    step: int
    """The step it was written at."""
    size: int
    """Bytes."""
    filename: str
    """job-<id>-step-<n>.pt"""


class NoCheckpoint(LookupError):
    """The job has no whole checkpoint to serve; the message says why."""


@dataclass(frozen=True, slots=True)
class Found:
    key: str
    step: int
    size: int

    def filename(self, job_id: int) -> str:
        return f"job-{job_id}-step-{self.step}.pt"

    def public(self, job_id: int) -> CheckpointPublic:
        return CheckpointPublic(job_id=job_id, step=self.step, size=self.size, filename=self.filename(job_id))


def _prefix(session: Session, job: Job) -> tuple[str, str]:
    """(the store prefix of the job's checkpoints, why there may be none there)."""
    if job.selection_id is None:
        pieces = checkpoint_pieces((job.spec or {}).get("parallel") or {})
        if pieces > 1:
            raise NoCheckpoint(
                f"job {job.id} writes each checkpoint in {pieces} pieces (one per pipeline stage and "
                "tensor rank): there is no whole checkpoint to download"
            )
        every = (job.spec or {}).get("checkpoint_every") or 0
        cadence = f"every {every} steps and " if every else ""
        return checkpoints_prefix(job.id), f"it writes one {cadence}at its end"
    trial = session.scalar(select(Trial).where(Trial.job_id == job.id))
    if trial is None:
        raise NoCheckpoint(f"job {job.id} is a selection trial that has not started")
    sel = session.get(Selection, job.selection_id)
    policy = ((sel.request if sel is not None else None) or {}).get("checkpoints") or "best"
    ended = "a trial's checkpoint is written when it ends"
    why = {
        "none": f"selection {job.selection_id} keeps no trial's checkpoints (checkpoints: none)",
        "best": f"selection {job.selection_id} keeps only its best trial's checkpoint (checkpoints: best); "
        + ended,
    }.get(policy, ended)
    return f"{selection_prefix(job.selection_id)}/trial-{trial.index}", why


def newest_checkpoint(settings: Settings, session: Session, job: Job) -> Found:
    """The newest whole checkpoint of `job` in the store; NoCheckpoint with the reason when there
    is none (StorageError when the store fails)."""
    prefix, why = _prefix(session, job)
    sizes = get_storage(settings).sizes(prefix)
    found: list[Found] = []
    for key, size in sizes.items():
        m = _STEP_FILE.match(key.removeprefix(prefix + "/"))
        if m and size > 0:
            found.append(Found(key=key, step=int(m.group(1)), size=size))
    if not found:
        raise NoCheckpoint(f"job {job.id} has no checkpoint yet ({why})")
    return max(found, key=lambda f: f.step)


def open_checkpoint(settings: Settings, found: Found) -> Iterator[bytes]:
    """The checkpoint's bytes in chunks, from a file opened now: a checkpoint pruned meanwhile
    (a running job keeps its newest few) is still read whole from the open file."""
    fh = get_storage(settings).open_read(found.key)

    def chunks() -> Iterator[bytes]:
        try:
            while block := fh.read(CHUNK):
                yield block
        finally:
            fh.close()

    return chunks()
