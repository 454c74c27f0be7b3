"""Which memory a piece of code really computes on: a census of storages, taken while it runs.

    with DeviceCensus(device) as census:
        engine.train_step(x, y)
    census.alive()        # storages the kernels ran on that are still held after the step
    census.peak_bytes     # most bytes of such storages alive at once during the step

Every operator that runs inside the block is seen (a TorchDispatchMode, so autograd's backward too).
The storages of its tensor arguments on `device` are recorded, unless the operator only moves or
re-labels memory: copies (`copy_`, `_to_copy`), host read-backs (`.item()`) and views. So a storage
is in the census when some kernel read or wrote it on the device, which is what "resident on the
device" means for the step. This matters where the device is the CPU (the tests here): host and
"device" buffers are then the same kind of memory and `tensor.device` cannot tell them apart, but a
host buffer is only ever a copy endpoint, never computed on. On CUDA the same census applies, and
`device` filters out host tensors as well.

Only floating-point storages are counted: integer tensors (token ids, indices) are, on the CPU,
views of the data set itself, where a device would hold a small copy of one batch.

The census is independent of the ledgers the code under test keeps: it reads the tensors the
kernels received, not the numbers the code entered. Storage liveness is a weak reference to the
storage itself (so a view dying does not hide a buffer that is still held). `live_bytes()` can be
called from inside the block (e.g. when an optimizer step begins) for a snapshot.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

_MOVES = {
    torch.ops.aten.copy_.default,
    torch.ops.aten._to_copy.default,
    torch.ops.aten._local_scalar_dense.default,
    torch.ops.aten.lift_fresh.default,
}


@dataclass(slots=True)
class Seen:
    ref: StorageWeakRef
    nbytes: int
    dtype: torch.dtype
    device: torch.device

    @property
    def alive(self) -> bool:
        return not self.ref.expired()


class DeviceCensus(TorchDispatchMode):
    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.device = torch.device(device)
        self.seen: dict[StorageWeakRef, Seen] = {}
        self.peak_bytes = 0
        self._live: dict[StorageWeakRef, int] = {}
        self._live_bytes = 0

    def _on_device(self, t: torch.Tensor) -> bool:
        d = t.device
        return d.type == self.device.type and (self.device.index is None or d.index == self.device.index)

    def _record(self, t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        ref = StorageWeakRef(storage)
        old = self.seen.get(ref)
        if old is not None and old.alive:
            return
        # a new storage (or a dead one's address reused: the old entry is replaced, it had expired)
        self.seen[ref] = Seen(ref=ref, nbytes=storage.nbytes(), dtype=t.dtype, device=t.device)
        self._live[ref] = storage.nbytes()
        self._live_bytes += storage.nbytes()

    def _prune(self) -> None:
        dead = [r for r in self._live if r.expired()]
        for r in dead:
            self._live_bytes -= self._live.pop(r)

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func not in _MOVES and not func.is_view:
            for a in tree_flatten((args, kwargs))[0]:
                if isinstance(a, torch.Tensor) and a.is_floating_point() and self._on_device(a):
                    self._record(a)
            self._prune()
            self.peak_bytes = max(self.peak_bytes, self._live_bytes)
        return func(*args, **kwargs)

    # -- reading the census ------------------------------------------------------------------------
    def alive(self) -> list[Seen]:
        return [s for s in self.seen.values() if s.alive]

    def alive_bytes(self, dtype: torch.dtype | None = None) -> int:
        return sum(s.nbytes for s in self.alive() if dtype is None or s.dtype == dtype)

    def live(self) -> list[Seen]:
        """The recorded storages alive right now (callable inside the block, for a snapshot)."""
        self._prune()
        return [self.seen[r] for r in self._live]

    def holds(self, t: torch.Tensor) -> bool:
        """Whether a kernel in the block computed on `t`'s storage."""
        seen = self.seen.get(StorageWeakRef(t.untyped_storage()))
        return seen is not None and seen.alive
