"""Device-memory ledger: the bytes the spilling engine holds on the device, entry by entry.

Every device tensor the engine keeps (a shard's parameters, gradients and optimizer state, the saved
activations of the shard being recomputed, boundary tensors, offload buckets) is entered under a key
when it is allocated and removed when it is released. The ledger is what the partitioner's plan is
checked against, on CPU as well as on CUDA; on CUDA `cuda_check` sets it beside the allocator's own
peak. What it does not see: autograd's transient gradient buffers inside one layer's backward and
kernel workspaces. The GPU tests give those a stated allowance.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

import torch

MiB = 2**20


class BudgetExceeded(RuntimeError):
    """The engine tried to hold more device bytes than its budget (a planning bug or a bad cut)."""


@dataclass(kw_only=True, slots=True)
class LedgerEvent:
    seq: int
    time: float
    key: str
    delta: int
    held: int


@dataclass(kw_only=True, slots=True)
class DeviceLedger:
    budget_bytes: int | None = None
    """Raise `BudgetExceeded` when `strict` and the held bytes pass this; None = unbounded."""
    strict: bool = False
    history: int = 20_000
    """Events kept for the timeline (oldest dropped first); peaks are exact regardless."""
    held: int = 0
    peak: int = 0
    step_peak: int = 0
    """Peak since the last `new_step()`: the per-step memory metric."""
    resident_peak: int = 0
    """Most shards whose parameters were on the device at once since the last `new_step()`."""
    entries: dict[str, int] = field(default_factory=dict)
    events: deque[LedgerEvent] = field(init=False)
    _seq: int = 0

    def __post_init__(self) -> None:
        self.events = deque(maxlen=self.history)

    def hold(self, key: str, nbytes: int) -> None:
        """Enter `nbytes` under `key`; holding a key again replaces its size."""
        old = self.entries.get(key, 0)
        self.entries[key] = int(nbytes)
        self._change(key, int(nbytes) - old)

    def release(self, key: str) -> None:
        old = self.entries.pop(key, 0)
        if old:
            self._change(key, -old)

    def release_prefix(self, prefix: str) -> None:
        for key in [k for k in self.entries if k.startswith(prefix)]:
            self.release(key)

    def _change(self, key: str, delta: int) -> None:
        self.held += delta
        if key.endswith(".params") and delta > 0:
            resident = sum(1 for k in self.entries if k.endswith(".params"))
            self.resident_peak = max(self.resident_peak, resident)
        self._seq += 1
        self.events.append(
            LedgerEvent(seq=self._seq, time=time.perf_counter(), key=key, delta=delta, held=self.held)
        )
        if self.held > self.peak:
            self.peak = self.held
        if self.held > self.step_peak:
            self.step_peak = self.held
        if self.strict and self.budget_bytes is not None and self.held > self.budget_bytes:
            top = sorted(self.entries.items(), key=lambda kv: -kv[1])[:6]
            raise BudgetExceeded(
                f"device ledger holds {self.held / MiB:.3f} MiB > budget {self.budget_bytes / MiB:.3f} "
                f"MiB after '{key}' ({delta:+d} B); largest entries: "
                + ", ".join(f"{k}={v / MiB:.3f}MiB" for k, v in top)
            )

    def new_step(self) -> None:
        self.step_peak = self.held
        self.resident_peak = sum(1 for k in self.entries if k.endswith(".params"))

    def timeline(self) -> list[tuple[int, str, int]]:
        """(seq, key, held bytes after the event) for the kept history."""
        return [(e.seq, e.key, e.held) for e in self.events]


def cuda_check(ledger: DeviceLedger, *, device: torch.device, baseline_bytes: int = 0) -> dict[str, float]:
    """The ledger's peak beside `torch.cuda.max_memory_allocated` (minus what was allocated before
    the engine started), in MiB. Call `torch.cuda.reset_peak_memory_stats` before the run."""
    real = torch.cuda.max_memory_allocated(device) - baseline_bytes
    return {
        "ledger_peak_mb": ledger.peak / MiB,
        "cuda_peak_mb": real / MiB,
        "untracked_mb": (real - ledger.peak) / MiB,
    }


class SavedActivations:
    """Counts the bytes autograd saves for backward inside the `with` block, each storage once,
    leaving out storages the caller already accounts for (the shard's parameters, its boundary
    input). Works on meta tensors too, which is how the partitioner estimates without memory."""

    def __init__(self, exclude: list[torch.Tensor] | None = None) -> None:
        self._exclude = {t.untyped_storage()._cdata for t in exclude or []}
        self._seen: dict[int, int] = {}
        self._ctx = torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        key = storage._cdata
        if key not in self._exclude and key not in self._seen:
            self._seen[key] = storage.nbytes()
        # not `t` itself: a tensor an op saves of its own output (softmax, flash attention) would
        # then hold its grad_fn, which holds it, a cycle nothing collects. A graph never run
        # backward (measure_layers' trial) kept every activation on the device (192 MiB of a
        # 129 MiB budget, seen on the lent H100)
        return t.detach()

    @property
    def nbytes(self) -> int:
        return sum(self._seen.values())

    def __enter__(self) -> SavedActivations:
        self._ctx.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._ctx.__exit__(*exc)


def _unpack(t: torch.Tensor) -> torch.Tensor:
    return t
