"""/api/webhooks: a user's endpoints told when their jobs and batches end, and each one's
delivery log. Another user's webhook reads as absent; an admin sees everyone's."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, HTTPException, Query, status

from api.auth import CurrentUser
from api.convert import from_row
from api.deps import RowId, SessionDep, SettingsDep
from api.webhook_schemas import (
    AttemptPublic,
    DeliveriesPublic,
    DeliveryPublic,
    WebhookCreate,
    WebhookIssued,
    WebhookPublic,
    WebhooksPublic,
)
from core.egress import UnsafeUrl, check_url, egress_allow
from core.webhooks import new_secret
from db import webhooks as dbw
from db.jobs import NotFound, aware
from db.models import User, Webhook

router = APIRouter(prefix="/api/webhooks", tags=["webhooks"])


def webhook_public(hook: Webhook) -> WebhookPublic:
    return from_row(WebhookPublic, hook)


def _scope(user: User) -> int | None:
    return None if user.is_admin else user.id


@router.post("", status_code=status.HTTP_201_CREATED, response_model=WebhookIssued)
def create_webhook(
    body: WebhookCreate, session: SessionDep, settings: SettingsDep, user: CurrentUser
) -> WebhookIssued:
    """Refused with 422 naming `url` and its rule when the service may not send there (a host that
    does not resolve, or is or resolves to a non-public address the operator has not allowed);
    409 past the per-user cap."""
    try:
        check_url(body.url, allow=egress_allow(tuple(settings.webhook_allow)))
    except UnsafeUrl as e:
        raise HTTPException(status.HTTP_422_UNPROCESSABLE_ENTITY, f"url: {e}") from e
    secret = new_secret()
    try:
        hook = dbw.create_webhook(
            session,
            user_id=user.id,
            url=body.url,
            events=body.events,
            secret=secret,
            max_per_user=settings.webhook_max_per_user,
        )
    except dbw.TooManyWebhooks as e:
        raise HTTPException(status.HTTP_409_CONFLICT, f"webhooks: {e}") from e
    return WebhookIssued(webhook=webhook_public(hook), secret=secret)


@router.get("", response_model=WebhooksPublic)
def list_webhooks(session: SessionDep, user: CurrentUser) -> WebhooksPublic:
    return WebhooksPublic(items=[webhook_public(h) for h in dbw.list_webhooks(session, user_id=_scope(user))])


@router.delete("/{webhook_id}", response_model=WebhookPublic)
def delete_webhook(webhook_id: RowId, session: SessionDep, user: CurrentUser) -> WebhookPublic:
    """Deliveries still pending go with it."""
    try:
        return webhook_public(dbw.delete_webhook(session, webhook_id=webhook_id, user_id=_scope(user)))
    except NotFound as e:
        raise HTTPException(status.HTTP_404_NOT_FOUND, str(e)) from e


@router.get("/{webhook_id}/deliveries", response_model=DeliveriesPublic)
def list_deliveries(
    webhook_id: RowId,
    session: SessionDep,
    user: CurrentUser,
    limit: Annotated[int, Query(ge=1, le=500)] = 50,
) -> DeliveriesPublic:
    """The newest deliveries first, each with every attempt (status code or error, time)."""
    try:
        dbw.get_webhook(session, webhook_id=webhook_id, user_id=_scope(user))
    except NotFound as e:
        raise HTTPException(status.HTTP_404_NOT_FOUND, str(e)) from e
    items = [
        from_row(
            DeliveryPublic,
            d,
            attempts=[from_row(AttemptPublic, a) for a in attempts],
            next_at=aware(d.next_at) if d.state == "pending" else None,
        )
        for d, attempts in dbw.deliveries(session, webhook_id=webhook_id, limit=limit)
    ]
    return DeliveriesPublic(items=items)
