"""Webhook signing, URL rules and the deliverer that empties the outbox (db/webhooks.py).

Each POST carries `Shardyard-Signature: t=<unix seconds>,v1=<hex HMAC-SHA256(secret, "<t>.<body>")>`.
The receiver recomputes the HMAC over the exact bytes it got and refuses a `t` outside its replay
window (`verify` below; docs/operations.md shows the same check standalone). The same delivery is
retried with the same body and `Shardyard-Delivery` id, so a receiver can drop repeats.

The deliverer runs in the scheduler process (core/scheduler_proc.py, `shardyard scheduler`). It
claims due rows with a lease, so several deliverers (one per API process's scheduler child) never
POST one delivery at once, and a deliverer that dies mid-POST leaves its rows to the others once the
lease runs out. POSTs run on a bounded thread pool, each within one deadline (webhook_timeout_s for
connect, send and read together): a receiver that hangs or drips its answer holds one thread until
the deadline and delays no other delivery, and nothing that ends a job waits on it.

Where a POST may go is core/egress.py's business: the URL is checked when the webhook is made and
again before every POST, and the POST connects to exactly the addresses that check resolved.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import secrets
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from core.egress import (
    ANSWER_MAX_BYTES,
    DeliveryFailed,
    EgressAllow,
    Proxy,
    UnsafeUrl,
    check_url,
    egress_allow,
    post,
)
from core.settings import Settings
from core.telemetry import WEBHOOK_ATTEMPTS
from db import webhooks as dbw
from db.connection import session_for

log = logging.getLogger(__name__)

SIGNATURE_HEADER = "Shardyard-Signature"
DELIVERY_HEADER = "Shardyard-Delivery"
EVENT_HEADER = "Shardyard-Event"
REPLAY_WINDOW_S = 300
"""The window `verify` allows between the signed time and the receiver's clock, either way."""
MAX_BACKOFF_S = 3600.0

__all__ = [
    "ANSWER_MAX_BYTES",
    "Deliverer",
    "UnsafeUrl",
    "backoff_s",
    "check_url",
    "new_secret",
    "sign",
    "verify",
]


def new_secret() -> str:
    return "whsec_" + secrets.token_urlsafe(32)


def sign(secret: str, *, timestamp: int, body: str) -> str:
    mac = hmac.new(secret.encode(), f"{timestamp}.{body}".encode(), hashlib.sha256).hexdigest()
    return f"t={timestamp},v1={mac}"


def verify(
    secret: str, *, header: str, body: str, now: float | None = None, window_s: float = REPLAY_WINDOW_S
) -> bool:
    """True when `header` signs `body` with `secret` within `window_s` of `now`."""
    parts = dict(p.split("=", 1) for p in header.split(",") if "=" in p)
    try:
        ts = int(parts["t"])
    except (KeyError, ValueError):
        return False
    if abs((time.time() if now is None else now) - ts) > window_s:
        return False
    want = sign(secret, timestamp=ts, body=body).split("v1=", 1)[1]
    return hmac.compare_digest(want, parts.get("v1", ""))


def backoff_s(settings: Settings, attempts_done: int) -> float:
    """Wait before the next attempt after `attempts_done` failed ones: doubling, capped."""
    return min(MAX_BACKOFF_S, settings.webhook_backoff_s * 2.0 ** max(0, attempts_done - 1))


class Deliverer:
    """Poll the outbox, POST what is due on a bounded pool, record every attempt."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.allow: EgressAllow = egress_allow(tuple(settings.webhook_allow))
        self.proxy: Proxy | None = None
        self.misconfigured: str | None = None
        """Why no delivery may go out (a proxy setting that does not parse): every attempt fails
        with it rather than going direct, and the scheduler this runs beside keeps placing jobs."""
        try:
            self.proxy = Proxy.parse(settings.webhook_proxy)
        except ValueError as e:
            self.misconfigured = str(e)
            log.error("webhooks will not be delivered: %s", e)
        self.pool = ThreadPoolExecutor(max_workers=settings.webhook_concurrency, thread_name_prefix="webhook")
        self.busy = 0
        self._lock = threading.Lock()
        self.stop_event = threading.Event()
        self.thread: threading.Thread | None = None

    @property
    def lease_s(self) -> float:
        # past the POST's deadline, with room for the name's resolution before it
        return self.settings.webhook_timeout_s + 60.0

    def poll(self) -> int:
        """Claim as many due deliveries as there are free threads; returns how many."""
        with self._lock:
            free = self.settings.webhook_concurrency - self.busy
        if free <= 0:
            return 0
        with session_for(self.settings.database_url) as session:
            claimed = dbw.claim_due(session, limit=free, lease_s=self.lease_s)
        for c in claimed:
            with self._lock:
                self.busy += 1
            self.pool.submit(self._deliver, c)
        return len(claimed)

    def _deliver(self, c: dbw.Claimed) -> None:
        try:
            self.deliver(c)
        except Exception:  # noqa: BLE001 - the lease runs out and the delivery is due again
            log.exception("webhook delivery %s failed to record", c.id)
        finally:
            with self._lock:
                self.busy -= 1

    def deliver(self, c: dbw.Claimed) -> None:
        s = self.settings
        body = (
            c.body if isinstance(c.body, str) else json.dumps(c.body, separators=(",", ":"), sort_keys=True)
        )
        status_code: int | None = None
        error: str | None = None
        started = time.monotonic()
        try:
            if self.misconfigured is not None:
                raise DeliveryFailed(self.misconfigured)
            # checked again: the name may resolve elsewhere now, or the allow-list have changed
            target = check_url(c.url, allow=self.allow)
            ts = int(time.time())
            answer = post(
                target,
                body=body.encode(),
                headers={
                    "Content-Type": "application/json",
                    "User-Agent": "shardyard-webhook",
                    SIGNATURE_HEADER: sign(c.secret, timestamp=ts, body=body),
                    DELIVERY_HEADER: str(c.id),
                    EVENT_HEADER: c.event,
                },
                timeout_s=s.webhook_timeout_s,
                proxy=self.proxy,
            )
            # redirects are not followed (they count as failures): one could point anywhere
            status_code = answer.status
            if not 200 <= status_code < 300:
                error = f"answered {status_code}"
        except (UnsafeUrl, DeliveryFailed) as e:
            error = str(e)[:500]
        except OSError as e:  # refused, unreachable, reset, a TLS certificate that does not match
            error = f"{type(e).__name__}: {e}"[:500]
        delivered = error is None
        done = c.attempts + 1
        retry = None if delivered or done >= s.webhook_attempts else backoff_s(s, done)
        WEBHOOK_ATTEMPTS.labels(
            "delivered" if delivered else "retry" if retry is not None else "gave_up"
        ).inc()
        if not delivered:
            log.info("webhook delivery %s to %s: %s (attempt %d)", c.id, c.url, error, done)
        with session_for(s.database_url) as session:
            dbw.record_attempt(
                session,
                delivery_id=c.id,
                body=body,
                status_code=status_code,
                error=error,
                seconds=time.monotonic() - started,
                delivered=delivered,
                retry_in_s=retry,
            )

    def run(self) -> None:
        while not self.stop_event.is_set():
            try:
                self.poll()
            except Exception:  # noqa: BLE001 - a locked or unreachable database passes
                log.warning("webhook outbox poll failed", exc_info=True)
            self.stop_event.wait(self.settings.webhook_poll_s)

    def start(self) -> Deliverer:
        self.thread = threading.Thread(target=self.run, daemon=True, name="webhooks")
        self.thread.start()
        return self

    def stop(self) -> None:
        """Stop claiming; POSTs in flight are abandoned to their leases (they are retried)."""
        self.stop_event.set()
        self.pool.shutdown(wait=False, cancel_futures=True)
