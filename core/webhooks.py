"""Webhook signing, URL rules and the deliverer that empties the outbox (db/webhooks.py).

Each POST carries `Shardyard-Signature: t=<unix seconds>,v1=<hex HMAC-SHA256(secret, "<t>.<body>")>`.
The receiver recomputes the HMAC over the exact bytes it got and refuses a `t` outside its replay
window (`verify` below; docs/operations.md shows the same check standalone). The same delivery is
retried with the same body and `Shardyard-Delivery` id, so a receiver can drop repeats.

The deliverer runs in the scheduler process (core/scheduler_proc.py, `shardyard scheduler`). It
claims due rows with a lease, so several deliverers (one per API process's scheduler child) never
POST one delivery at once, and a deliverer that dies mid-POST leaves its rows to the others once the
lease runs out. POSTs run on a bounded thread pool with a timeout: a receiver that hangs holds one
thread for webhook_timeout_s and delays no other delivery, and nothing that ends a job waits on it.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import json
import logging
import secrets
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import urlsplit

import httpx

from core.settings import Settings
from core.telemetry import WEBHOOK_ATTEMPTS
from db import webhooks as dbw
from db.engine import session_for

log = logging.getLogger(__name__)

SIGNATURE_HEADER = "Shardyard-Signature"
DELIVERY_HEADER = "Shardyard-Delivery"
EVENT_HEADER = "Shardyard-Event"
REPLAY_WINDOW_S = 300
"""The window `verify` allows between the signed time and the receiver's clock, either way."""
MAX_BACKOFF_S = 3600.0


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


class UnsafeUrl(ValueError):
    pass


def _non_public(host: str) -> str | None:
    """The first address of `host` that is not a public one, if any (unresolvable: None)."""
    try:
        infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except (OSError, UnicodeError, ValueError):
        return None
    for info in infos:
        addr = ipaddress.ip_address(str(info[4][0]).split("%", 1)[0])
        if not addr.is_global:
            return str(addr)
    return None


def check_url(url: str, *, allow_private: bool) -> None:
    """http(s) with a host; and unless allowed, no host on a loopback, private or link-local
    address. Checked at creation and again before every POST (a name may change what it resolves
    to); a name that resolves to a private address only between the check and the connect is not
    caught here, which is why production should also send through an egress proxy or firewall."""
    try:
        parts = urlsplit(url)
        host = parts.hostname
    except ValueError as e:  # an unclosed [ of an IPv6 literal, and the like
        raise UnsafeUrl(f"the URL cannot be parsed: {e}") from e
    if any(ord(ch) < 0x21 for ch in url):
        raise UnsafeUrl("the URL must not contain spaces or control characters")
    if parts.scheme not in ("http", "https"):
        raise UnsafeUrl(f"the URL's scheme must be http or https, not {parts.scheme!r}")
    if not host:
        raise UnsafeUrl("the URL has no host")
    if parts.username or parts.password:
        raise UnsafeUrl("the URL must not carry a user name or password")
    if allow_private:
        return
    bad = _non_public(host)
    if bad is not None:
        raise UnsafeUrl(
            f"the host {host} is a non-public address ({bad}); an admin may allow such "
            "hosts with SHARDYARD_WEBHOOK_ALLOW_PRIVATE=1"
        )


def backoff_s(settings: Settings, attempts_done: int) -> float:
    """Wait before the next attempt after `attempts_done` failed ones: doubling, capped."""
    return min(MAX_BACKOFF_S, settings.webhook_backoff_s * 2 ** max(0, attempts_done - 1))


class Deliverer:
    """Poll the outbox, POST what is due on a bounded pool, record every attempt."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.pool = ThreadPoolExecutor(max_workers=settings.webhook_concurrency, thread_name_prefix="webhook")
        self.busy = 0
        self._lock = threading.Lock()
        self.stop_event = threading.Event()
        self.thread: threading.Thread | None = None

    @property
    def lease_s(self) -> float:
        # past the POST's own timeouts (connect, write and read each get webhook_timeout_s)
        return 3 * self.settings.webhook_timeout_s + 30.0

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
            check_url(c.url, allow_private=s.webhook_allow_private)
            ts = int(time.time())
            resp = httpx.post(
                c.url,
                content=body.encode(),
                headers={
                    "Content-Type": "application/json",
                    "User-Agent": "shardyard-webhook",
                    SIGNATURE_HEADER: sign(c.secret, timestamp=ts, body=body),
                    DELIVERY_HEADER: str(c.id),
                    EVENT_HEADER: c.event,
                },
                timeout=s.webhook_timeout_s,
                follow_redirects=False,  # a redirect could point anywhere, private hosts included
            )
            status_code = resp.status_code
            if not 200 <= status_code < 300:
                error = f"answered {status_code}"
        except UnsafeUrl as e:
            error = str(e)
        except (httpx.HTTPError, httpx.InvalidURL) as e:
            error = f"{type(e).__name__}: {e}"[:500] or type(e).__name__
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
