"""What the routes that send a checkpoint share (a job's, a selection batch's best trial's): their
query options, their documented answers, the errors they map, and the streaming response."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Annotated, Any

from fastapi import HTTPException, Query, status
from fastapi.responses import StreamingResponse
from sqlalchemy.orm import Session

from api.checkpoints import NoCheckpoint, WeightsFormat, find_checkpoint, open_download
from api.weights import NotWeights
from core.settings import Settings
from core.storage import KeyMissing, StorageError
from db.models import Job

BestQuery = Annotated[
    bool,
    Query(
        description="the checkpoint at the step where the job's metric was best (a trial's batch metric, "
        "a job's val_loss) among those the store keeps, instead of the newest"
    ),
]
FormatQuery = Annotated[
    WeightsFormat,
    Query(description="pt: the trainer's whole checkpoint; safetensors: the model's weights alone"),
]


@contextlib.contextmanager
def checkpoint_errors(job_id: int) -> Iterator[None]:
    """The store's and the checkpoint's failures as the routes answer them."""
    try:
        yield
    except NoCheckpoint as e:
        raise HTTPException(status.HTTP_404_NOT_FOUND, str(e)) from e
    except NotWeights as e:
        raise HTTPException(
            status.HTTP_422_UNPROCESSABLE_CONTENT,
            f"format: job {job_id}'s checkpoint cannot be sent as safetensors: {e}",
        ) from e
    except KeyMissing as e:  # pruned between the listing and the open: the caller may ask again
        raise HTTPException(
            status.HTTP_404_NOT_FOUND, f"job {job_id}'s checkpoint was replaced by a newer one; ask again"
        ) from e
    except StorageError as e:
        raise HTTPException(status.HTTP_503_SERVICE_UNAVAILABLE, str(e)) from e


CHECKPOINT_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {
        "content": {"application/octet-stream": {}},
        "description": "the checkpoint, as a file named job-<id>-step-<n>.pt, or its weights as "
        "job-<id>-step-<n>.safetensors",
    },
    404: {"description": "no such job of yours, or it has no whole checkpoint (the reason)"},
    503: {"description": "the store did not answer (the reason)"},
}


def send_checkpoint(
    session: Session, settings: Settings, job: Job, *, best: bool, fmt: WeightsFormat
) -> StreamingResponse:
    """The response of a checkpoint download of `job` (the job's route and a batch's best trial)."""
    with checkpoint_errors(job.id):
        found = find_checkpoint(settings, session, job, best=best)
        got = open_download(settings, found, job_id=job.id, fmt=fmt)
    session.close()  # the stream holds no pooled connection while it sends
    headers = {
        "Content-Disposition": f'attachment; filename="{got.filename}"',
        "Content-Length": str(got.size),
        "X-Checkpoint-Step": str(got.step),
        "X-Job-Id": str(job.id),
    }
    return StreamingResponse(got.body, media_type=got.media_type, headers=headers)
