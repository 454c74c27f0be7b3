"""Per-device reservations: the bytes the selection executor's policy has planned on each device
(the spilling engine's DeviceLedger, trainer/spill/ledger.py, counts the bytes actually held).

The executor reserves a shard's bytes before it is copied in (or prefetched) and releases them when
the shard leaves; a reservation that would pass the budget is a bug in the policy, so it raises.
"""

from __future__ import annotations

import threading


class ReservationError(RuntimeError):
    """A reservation would pass the device's budget."""


class Reservations:
    def __init__(self, *, device: str, budget_bytes: int | None) -> None:
        self.device = device
        self.budget_bytes = budget_bytes
        """None: no budget (a CPU 'device' whose memory is the host's)."""
        self.used_bytes = 0
        self.peak_bytes = 0
        self._held: dict[object, int] = {}
        self._lock = threading.Lock()

    def free_bytes(self) -> int | None:
        with self._lock:
            return None if self.budget_bytes is None else self.budget_bytes - self.used_bytes

    def fits(self, nbytes: int) -> bool:
        free = self.free_bytes()
        return free is None or nbytes <= free

    def reserve(self, key: object, nbytes: int) -> None:
        with self._lock:
            if key in self._held:
                raise ReservationError(f"{self.device}: {key!r} is already placed ({self._held[key]} bytes)")
            if self.budget_bytes is not None and self.used_bytes + nbytes > self.budget_bytes:
                raise ReservationError(
                    f"{self.device}: placing {key!r} ({nbytes} bytes) on top of {self.used_bytes} bytes "
                    f"passes the budget of {self.budget_bytes} bytes"
                )
            self._held[key] = nbytes
            self.used_bytes += nbytes
            self.peak_bytes = max(self.peak_bytes, self.used_bytes)

    def release(self, key: object) -> None:
        with self._lock:
            self.used_bytes -= self._held.pop(key)

    def holds(self, key: object) -> bool:
        with self._lock:
            return key in self._held
