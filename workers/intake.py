"""Whether this worker could take a task, and the orders it could have taken and never got.

The scheduler reserves a worker's slots and sends the order (a Celery task) to that worker's own
queue; the worker claims it in the database as the first thing the task does. An order can still
go missing between the two (a broker that restarted empty, a message stranded with a pool process
that died), and the scheduler alone cannot tell a lost order from one whose worker is still
starting or busy: re-sent on a timer, a slow start gets a duplicate. The worker can tell. Its main
process samples, several times a second, whether it could take a task now (`free`: ready,
connected to the broker, a pool process free and no other task held); its heartbeat reads the
orders placed on it that are still unclaimed and, for one it could have taken for `grace_s`
since it first saw it, asks the scheduler to send it again (db/scheduling.py order_lost).

The clock is this process's monotonic one only: no time of another host is compared with it. An
order is first seen after its reservation is committed, which the scheduler does before it sends,
so `grace_s` covers that gap as well as the consumer's fetch.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from datetime import datetime

from db.scheduling import Order

BACKOFF_MAX = 64
"""The longest wait before asking again, in grace periods (10 s: about 11 minutes)."""


class Intake:
    """One worker's readiness over time and the unclaimed orders its heartbeat has seen."""

    def __init__(self, *, grace_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.grace_s = grace_s
        self.clock = clock
        self.free_since: float | None = None
        """When the current span of `free` samples began; None while the worker could not take
        a task (at its last sample)."""
        self.seen: dict[tuple[int, datetime], float] = {}
        """(reservation id, sent_at) -> when the heartbeat first saw that order unclaimed. A
        re-sent order has a new sent_at, so its wait starts again."""
        self.asked: dict[int, int] = {}
        """Reservation id -> how often this worker asked for it again. Each ask doubles the next
        wait (up to BACKOFF_MAX times grace_s): an order the worker gets and drops without a claim
        (a task it does not know, from a newer or older release) is asked for ever less often,
        not every few seconds for ever."""
        self.lock = threading.Lock()

    def sample(self, free: bool) -> None:
        """The worker could (or could not) take a task now."""
        with self.lock:
            if not free:
                self.free_since = None
            elif self.free_since is None:
                self.free_since = self.clock()

    @property
    def free(self) -> bool:
        with self.lock:
            return self.free_since is not None

    def lost(self, unclaimed: Sequence[Order]) -> list[Order]:
        """Of `unclaimed` (every order placed here and not yet claimed, as read now), those this
        worker could have taken, without a break, for `grace_s` since it first saw them."""
        now = self.clock()
        with self.lock:
            since = self.free_since
            seen = {
                (o.reservation_id, o.sent_at): self.seen.get((o.reservation_id, o.sent_at), now)
                for o in unclaimed
            }
            self.seen = seen
            self.asked = {o.reservation_id: self.asked.get(o.reservation_id, 0) for o in unclaimed}
            if since is None:
                return []
            out = [
                o
                for o in unclaimed
                if now - max(seen[(o.reservation_id, o.sent_at)], since) >= self.wait_s(o.reservation_id)
            ]
            for o in out:
                del seen[(o.reservation_id, o.sent_at)]
                self.asked[o.reservation_id] += 1
            return out

    def wait_s(self, reservation_id: int) -> float:
        """How long the worker waits, free, before it asks for this order (again)."""
        return self.grace_s * min(2 ** self.asked.get(reservation_id, 0), BACKOFF_MAX)

    def times_asked(self, reservation_id: int) -> int:
        with self.lock:
            return self.asked.get(reservation_id, 0)


__all__ = ["Intake"]
