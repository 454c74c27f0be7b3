"""Request and response models of webhooks and their delivery log."""

from __future__ import annotations

from datetime import datetime
from typing import Literal

from pydantic import BaseModel, Field

from api.schemas import Strict


class WebhookCreate(Strict):
    url: str = Field(min_length=1, max_length=2000, description="http(s) URL the service POSTs to")
    events: Literal["all", "failures"] = Field(
        "all", description="`all`: every end (succeeded, failed, cancelled); `failures`: failed only"
    )


class WebhookPublic(BaseModel):
    id: int
    user_id: int
    url: str
    events: str
    created_at: datetime


class WebhookIssued(BaseModel):
    """The secret that signs the deliveries: shown once, here."""

    webhook: WebhookPublic
    secret: str


class WebhooksPublic(BaseModel):
    items: list[WebhookPublic]


class AttemptPublic(BaseModel):
    at: datetime
    status_code: int | None
    error: str | None
    seconds: float


class DeliveryPublic(BaseModel):
    id: int
    event: str
    object_id: int
    status: str
    state: str
    """`pending` (next attempt at next_at), `delivered` or `failed` (gave up)."""
    attempts: list[AttemptPublic]
    created_at: datetime
    next_at: datetime | None
    delivered_at: datetime | None


class DeliveriesPublic(BaseModel):
    items: list[DeliveryPublic]
