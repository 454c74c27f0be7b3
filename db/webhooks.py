"""Webhooks and their outbox: a user's endpoints, the deliveries the end-of-job triggers queue
(the webhooks migration, 0013), claims with a lease, and the log of every attempt."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import and_, func, or_, select, update
from sqlalchemy.orm import Session

from db.connection import rowcount
from db.jobs import NotFound, aware, db_now
from db.models import Job, Selection, User, Webhook, WebhookAttempt, WebhookDelivery


class TooManyWebhooks(Exception):
    pass


def create_webhook(
    session: Session, *, user_id: int, url: str, events: str, secret: str, max_per_user: int = 0
) -> Webhook:
    """A new webhook of `user_id`; TooManyWebhooks when the user has `max_per_user` already (0: no
    limit). Counted after the insert, in its transaction, with the user's row locked first on
    PostgreSQL: two creates at once cannot both pass the count (SQLite's writer lock, taken by
    the insert, does the same there)."""
    if max_per_user > 0:
        session.execute(select(User.id).where(User.id == user_id).with_for_update())
    hook = Webhook(user_id=user_id, url=url, events=events, secret=secret)
    session.add(hook)
    session.flush()
    if max_per_user > 0:
        have = session.scalar(select(func.count()).select_from(Webhook).where(Webhook.user_id == user_id))
        if (have or 0) > max_per_user:
            session.rollback()
            raise TooManyWebhooks(
                f"a user may have at most {max_per_user} webhooks (SHARDYARD_WEBHOOK_MAX_PER_USER) and "
                f"this one has {max_per_user} already; delete one first"
            )
    session.commit()
    return hook


def list_webhooks(session: Session, *, user_id: int | None) -> list[Webhook]:
    """A user's webhooks; None: everyone's."""
    q = select(Webhook).order_by(Webhook.id)
    if user_id is not None:
        q = q.where(Webhook.user_id == user_id)
    return list(session.scalars(q))


def get_webhook(session: Session, *, webhook_id: int, user_id: int | None) -> Webhook:
    """Another user's webhook reads as absent (user_id None: an admin sees all)."""
    hook = session.get(Webhook, webhook_id)
    if hook is None or (user_id is not None and hook.user_id != user_id):
        raise NotFound(f"webhook {webhook_id} does not exist")
    return hook


def delete_webhook(session: Session, *, webhook_id: int, user_id: int | None) -> Webhook:
    hook = get_webhook(session, webhook_id=webhook_id, user_id=user_id)
    session.delete(hook)
    session.commit()
    return hook


def deliveries(
    session: Session, *, webhook_id: int, limit: int
) -> list[tuple[WebhookDelivery, list[WebhookAttempt]]]:
    """The newest deliveries of a webhook, each with its attempts (oldest first)."""
    rows = list(
        session.scalars(
            select(WebhookDelivery)
            .where(WebhookDelivery.webhook_id == webhook_id)
            .order_by(WebhookDelivery.id.desc())
            .limit(limit)
        )
    )
    attempts: dict[int, list[WebhookAttempt]] = {r.id: [] for r in rows}
    if rows:
        for a in session.scalars(
            select(WebhookAttempt)
            .where(WebhookAttempt.delivery_id.in_(list(attempts)))
            .order_by(WebhookAttempt.id)
        ):
            attempts[a.delivery_id].append(a)
    return [(r, attempts[r.id]) for r in rows]


@dataclass(frozen=True, slots=True)
class Claimed:
    """A delivery this deliverer holds until `lease_until`: what it needs to POST it."""

    id: int
    url: str
    secret: str
    event: str
    attempts: int
    body: dict[str, Any] | str


def claim_due(session: Session, *, limit: int, lease_s: float) -> list[Claimed]:
    """Up to `limit` due deliveries, each taken by a conditional update (pending, due, and no live
    lease), so two deliverers never POST the same one at once. A deliverer that dies leaves its
    lease to run out; the row is then due again."""
    now = db_now(session)
    due = and_(
        WebhookDelivery.state == "pending",
        WebhookDelivery.next_at <= now,
        or_(WebhookDelivery.lease_until.is_(None), WebhookDelivery.lease_until < now),
    )
    ids = list(
        session.scalars(select(WebhookDelivery.id).where(due).order_by(WebhookDelivery.next_at).limit(limit))
    )
    taken: list[Claimed] = []
    until = now + timedelta(seconds=lease_s)
    for delivery_id in ids:
        got = session.execute(
            update(WebhookDelivery).where(WebhookDelivery.id == delivery_id, due).values(lease_until=until)
        )
        if rowcount(got) != 1:
            continue
        row = session.get(WebhookDelivery, delivery_id)
        hook = session.get(Webhook, row.webhook_id) if row is not None else None
        if row is None or hook is None:
            continue
        taken.append(
            Claimed(
                id=row.id,
                url=hook.url,
                secret=hook.secret,
                event=row.event,
                attempts=row.attempts,
                body=row.body if row.body is not None else _payload(session, row),
            )
        )
    session.commit()
    return taken


def _iso(dt: datetime | None) -> str | None:
    return aware(dt).isoformat() if dt is not None else None


def _payload(session: Session, row: WebhookDelivery) -> dict[str, Any]:
    """What the receiver is told, read once at the first attempt: the job's or the batch's id and
    status, and what its row says of it while it still exists."""
    base: dict[str, Any] = {"event": row.event, "delivery_id": row.id, "status": row.status}
    kind = "job" if row.event == "job.ended" else "selection"
    about = base[kind] = {"id": row.object_id, "status": row.status}
    obj: Job | Selection | None = (
        session.get(Job, row.object_id) if kind == "job" else session.get(Selection, row.object_id)
    )
    if obj is None:
        return base
    about.update(name=obj.name, error=obj.error)
    if isinstance(obj, Job):
        about.update(steps=obj.steps, step=obj.step, attempts=obj.attempts)
    else:
        about.update(metric=obj.metric, trials=len(obj.trials))
    about["finished_at"] = _iso(obj.finished_at)
    return base


def record_attempt(
    session: Session,
    *,
    delivery_id: int,
    body: str,
    status_code: int | None,
    error: str | None,
    seconds: float,
    delivered: bool,
    retry_in_s: float | None,
) -> None:
    """Log one POST and settle the row: delivered; due again in `retry_in_s`; or given up (None)."""
    if session.get(WebhookDelivery, delivery_id) is None:
        return  # its webhook was deleted while the POST was out
    now = db_now(session)
    session.add(
        WebhookAttempt(delivery_id=delivery_id, at=now, status_code=status_code, error=error, seconds=seconds)
    )
    values: dict[str, Any] = {
        "attempts": WebhookDelivery.attempts + 1,
        "body": body,
        "lease_until": None,
    }
    if delivered:
        values.update(state="delivered", delivered_at=now)
    elif retry_in_s is None:
        values.update(state="failed")
    else:
        values.update(next_at=now + timedelta(seconds=retry_in_s))
    session.execute(update(WebhookDelivery).where(WebhookDelivery.id == delivery_id).values(**values))
    session.commit()


def outbox_counts(session: Session) -> dict[str, int]:
    """Deliveries by state (the metrics' outbox gauge)."""
    q = select(WebhookDelivery.state, func.count()).group_by(WebhookDelivery.state)
    return {str(state): int(n) for state, n in session.execute(q)}


__all__ = [
    "Claimed",
    "NotFound",
    "TooManyWebhooks",
    "claim_due",
    "create_webhook",
    "delete_webhook",
    "deliveries",
    "get_webhook",
]
