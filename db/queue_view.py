"""What the API's queue positions (api/queue.py) read beside the scheduler's own queue reads
(db/scheduling.py): a check on the queued jobs' priorities, which their versions do not carry."""

from __future__ import annotations

from sqlalchemy import BigInteger, cast, func, select
from sqlalchemy.orm import Session

from db.models import Job
from db.scheduling import _QUEUED_WHERE  # the queue's one definition

_PRIORITIES = select(
    func.coalesce(func.sum(Job.priority), 0),
    # 64-bit, as the queue's fingerprint: PostgreSQL multiplies two integers in 32 bits
    func.coalesce(func.sum(cast(Job.priority, BigInteger) * cast(Job.id, BigInteger)), 0),
).where(_QUEUED_WHERE)


def queued_priorities(session: Session) -> tuple[int, int]:
    """(sum of priorities, sum of priority times id) of the jobs db/scheduling.py queued_jobs reads:
    a job whose priority was changed in place (same id, same version) changes the second."""
    total, weighted = session.execute(_PRIORITIES).one()
    return int(total), int(weighted)
