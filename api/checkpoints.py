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

import math
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel
from sqlalchemy import select
from sqlalchemy.orm import Session

from api import weights
from core.settings import Settings
from core.storage import checkpoints_prefix, get_storage, selection_prefix
from db.models import Job, MetricPoint, Selection, Trial
from jobrules.parallel import checkpoint_pieces

_STEP_FILE = re.compile(r"^step-(\d+)\.pt$")
CHUNK = 1 << 20


WeightsFormat = Literal["pt", "safetensors"]
"""`pt`: the trainer's whole checkpoint (weights, optimizer and loop state), as torch.load reads
it; `safetensors`: the model's weights alone (api/weights.py)."""


class CheckpointPublic(BaseModel):
    """What `GET /api/jobs/{id}/checkpoint` would send now."""

    job_id: int
    step: int
    """The step it was written at."""
    size: int
    """Bytes."""
    filename: str
    """job-<id>-step-<n>.pt (or .safetensors)"""
    format: WeightsFormat = "pt"
    best: bool = False
    """It is the checkpoint at the job's best metric step (`best=true`), not its newest."""
    metric: str | None = None
    """With `best`: the metric it is best by (the batch's for a trial, val_loss for a job)."""
    value: float | None = None
    """With `best`: the metric's value at its step."""


class NoCheckpoint(LookupError):
    """The job has no whole checkpoint to serve; the message says why."""


@dataclass(frozen=True, slots=True)
class Found:
    key: str
    step: int
    size: int
    metric: str | None = None
    value: float | None = None
    """Set for the checkpoint at the best metric step (best_checkpoint)."""

    def filename(self, job_id: int, fmt: str = "pt") -> str:
        return f"job-{job_id}-step-{self.step}.{fmt}"

    def public(self, job_id: int) -> CheckpointPublic:
        return CheckpointPublic(
            job_id=job_id,
            step=self.step,
            size=self.size,
            filename=self.filename(job_id),
            best=self.metric is not None,
            metric=self.metric,
            value=self.value,
        )


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


def _kept(settings: Settings, session: Session, job: Job) -> list[Found]:
    """Every whole checkpoint of `job` in the store, oldest first; NoCheckpoint with the reason
    when there is none (StorageError when the store fails)."""
    prefix, why = _prefix(session, job)
    sizes = get_storage(settings).sizes(prefix)
    found: list[Found] = []
    for key, size in sizes.items():
        m = _STEP_FILE.match(key.removeprefix(prefix + "/"))
        if m and size > 0:
            found.append(Found(key=key, step=int(m.group(1)), size=size))
    if not found:
        raise NoCheckpoint(f"job {job.id} has no checkpoint yet ({why})")
    return sorted(found, key=lambda f: f.step)


def newest_checkpoint(settings: Settings, session: Session, job: Job) -> Found:
    """The newest whole checkpoint of `job` in the store; NoCheckpoint with the reason when there
    is none (StorageError when the store fails)."""
    return _kept(settings, session, job)[-1]


def best_checkpoint(settings: Settings, session: Session, job: Job) -> Found:
    """Of the checkpoints the store keeps for `job`, the one at the step where its metric was
    best: a trial's batch metric and mode, a job's val_loss (lowest). Only a step that has both a
    checkpoint and the metric counts (a job keeps its newest few checkpoints; evaluation runs
    every eval_every steps and at the end); NoCheckpoint with the steps of each when none does."""
    kept = _kept(settings, session, job)
    metric, mode = "val_loss", "min"
    if job.selection_id is not None and (sel := session.get(Selection, job.selection_id)) is not None:
        metric, mode = sel.metric, sel.mode
    values = dict(
        session.execute(
            select(MetricPoint.step, MetricPoint.value).where(
                MetricPoint.job_id == job.id,
                MetricPoint.name == metric,
                MetricPoint.step.in_([f.step for f in kept]),
            )
        ).all()
    )
    scored = [(f, values[f.step]) for f in kept if f.step in values and math.isfinite(values[f.step])]
    if not scored:
        steps = ", ".join(str(f.step) for f in kept)
        raise NoCheckpoint(
            f"job {job.id} has no kept checkpoint at a step with a {metric} value (checkpoints kept at "
            f"step(s) {steps}): download its newest instead"
        )
    sign = 1.0 if mode == "min" else -1.0
    best, value = min(scored, key=lambda fv: (sign * fv[1], -fv[0].step))
    return Found(key=best.key, step=best.step, size=best.size, metric=metric, value=value)


def find_checkpoint(settings: Settings, session: Session, job: Job, *, best: bool) -> Found:
    return best_checkpoint(settings, session, job) if best else newest_checkpoint(settings, session, job)


@dataclass(frozen=True, slots=True)
class Download:
    """A response's body and headers: the checkpoint file, or its weights as safetensors."""

    body: Iterator[bytes]
    size: int
    filename: str
    media_type: str
    step: int


def open_download(
    settings: Settings, found: Found, *, job_id: int, fmt: WeightsFormat, stream: bool = True
) -> Download:
    """The bytes to send for `found` in format `fmt` (NotWeights when a checkpoint holds no
    weights safetensors can carry; KeyMissing when it was pruned meanwhile). `stream` False: only
    its size and name (the body is empty, nothing left open)."""
    if not stream and fmt == "pt":
        return Download(
            body=iter(()), size=found.size, filename=found.filename(job_id), media_type="", step=found.step
        )
    if fmt == "pt":
        return Download(
            body=open_checkpoint(settings, found),
            size=found.size,
            filename=found.filename(job_id),
            media_type="application/octet-stream",
            step=found.step,
        )
    fh = get_storage(settings).open_read(found.key)
    try:
        laid = weights.plan(fh, metadata={"format": "pt", "job_id": str(job_id), "step": str(found.step)})
    except BaseException:
        fh.close()
        raise
    if not stream:
        fh.close()
    return Download(
        body=weights.stream(fh, laid) if stream else iter(()),
        size=laid.size,
        filename=found.filename(job_id, "safetensors"),
        media_type="application/octet-stream",
        step=found.step,
    )


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
