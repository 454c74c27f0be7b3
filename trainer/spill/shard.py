"""One shard of a spilled model: a run of consecutive layers with a host copy and, while resident,
a device copy of its parameters (and of its optimizer state while it steps).

The layers are the model's own modules; their `nn.Parameter` objects stay the same objects for the
whole run and only their `.data` moves: a view into the host flat buffer while spilled, a view into
the device flat buffer while resident. So a torch optimizer built over them keeps working, and the
host and device copies are separate tensors even when the "device" is the CPU (tests run that way,
through the same code path as CUDA).

Streams (CUDA): copies run on the engine's copy stream; `ready()` makes the compute stream wait for
them and tells the allocator the compute stream uses the buffers (`record_stream`), so a buffer
freed by a spill is not handed out again while a kernel or a copy still reads it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Self

import torch
from torch import nn

from trainer.models import lm_loss
from trainer.spill.ledger import DeviceLedger, SavedActivations

if TYPE_CHECKING:
    from trainer.spill.offload import OffloadedAdamW


def _host_empty(numel: int, dtype: torch.dtype) -> torch.Tensor:
    # pinned memory makes the host<->device copies asynchronous; only meaningful with CUDA
    return torch.zeros(numel, dtype=dtype, pin_memory=torch.cuda.is_available())


class Shard:
    """Layers [start, stop) of the model. See the engine's API note for how they are driven."""

    def __init__(
        self,
        *,
        index: int,
        start: int,
        stop: int,
        model: nn.Sequential,
        device: torch.device,
        param_dtype: torch.dtype,
        ledger: DeviceLedger,
        copy_stream: torch.cuda.Stream | None = None,
    ) -> None:
        self.index, self.start, self.stop = index, start, stop
        self.layers = model[start:stop]
        self.device, self.param_dtype = device, param_dtype
        self.ledger, self.copy_stream = ledger, copy_stream
        self.tag = f"s{index}"
        # slicing an nn.Sequential keeps the original keys, so these are the model's own names
        named = list(self.layers.named_parameters())
        self.names = [n for n, _ in named]
        self.params: list[nn.Parameter] = [p for _, p in named]
        self.shapes = [p.shape for p in self.params]
        self.offsets: list[int] = []
        total = 0
        for p in self.params:
            self.offsets.append(total)
            total += p.numel()
        self.numel = total
        # fp32 master copy in host memory; the parameters point into it while spilled
        self.host = _host_empty(total, torch.float32)
        for p, view in zip(self.params, self.views(self.host), strict=True):
            view.copy_(p.detach())
            p.data = view
        self.dev: torch.Tensor | None = None
        self.dev_grad: torch.Tensor | None = None
        self.grad_host: torch.Tensor | None = None
        """Gradients parked in host memory between the backward and a deferred step."""
        self.dirty = False
        """The device copy holds newer values than the host copy (a plain-mode step ran)."""
        self.bytes_in = 0
        self.bytes_out = 0
        """Bytes this shard copied to the device and back, for the benchmarks' copy budget."""
        self._ready_event: torch.cuda.Event | None = None
        self._pending: list[torch.Tensor] = []
        # optimizer: exactly one of the two is set by the engine
        self.opt: torch.optim.Optimizer | None = None
        self.state_host: dict[str, torch.Tensor] = {}
        self.state_dev: dict[str, torch.Tensor] | None = None
        self.offload: OffloadedAdamW | None = None

    # -- layout -----------------------------------------------------------------------------------

    @classmethod
    def cut(cls, model: nn.Sequential, bounds: Sequence[tuple[int, int]], **common: Any) -> list[Self]:
        """One shard for each [start, stop) of `bounds` (a partition plan's), numbered in order;
        `common`: the other arguments, the same for each (device, param_dtype, ledger, ...)."""
        return [cls(index=k, start=a, stop=b, model=model, **common) for k, (a, b) in enumerate(bounds)]

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        return [flat[o : o + s.numel()].view(s) for o, s in zip(self.offsets, self.shapes, strict=True)]

    @property
    def resident(self) -> bool:
        return self.dev is not None

    @property
    def elt(self) -> int:
        return torch.empty((), dtype=self.param_dtype).element_size()

    # -- plain optimizer state (flat, so it moves in one copy per kind) ------------------------------
    def attach_optimizer(self, opt: torch.optim.Optimizer, *, state_keys: list[str]) -> None:
        """Pre-create the optimizer's per-parameter state as views into flat host buffers (zeros
        give the same first step as torch's lazy init)."""
        self.opt = opt
        self.state_host = {k: _host_empty(self.numel, torch.float32) for k in state_keys}
        views = {k: self.views(self.state_host[k]) for k in state_keys}  # once per key, not per param
        for i, p in enumerate(self.params):
            st = opt.state[p]
            for k in state_keys:
                st[k] = views[k][i]
            if isinstance(opt, torch.optim.AdamW):
                st["step"] = torch.tensor(0.0, dtype=torch.float32)

    def _bind_state(self, flats: dict[str, torch.Tensor]) -> None:
        assert self.opt is not None
        for k, flat in flats.items():
            for p, view in zip(self.params, self.views(flat), strict=True):
                self.opt.state[p][k] = view

    # -- movement ---------------------------------------------------------------------------------
    def _copy_in(self, src: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        compute = torch.cuda.current_stream(self.device) if self.copy_stream is not None else None
        # allocate on the compute stream (its memory pool), copy on the copy stream
        dst = torch.empty(src.numel(), dtype=dtype, device=self.device)
        self.bytes_in += src.numel() * dst.element_size()
        if self.copy_stream is None:
            dst.copy_(src)
            return dst
        self.copy_stream.wait_stream(compute)
        with torch.cuda.stream(self.copy_stream):
            dst.copy_(src, non_blocking=True)
        # the copy stream writes it: a spill before `ready()` must not free it under the copy
        dst.record_stream(self.copy_stream)
        self._pending.append(dst)
        return dst

    def to_device(self, *, state: bool, grads: bool = False) -> None:
        """Start copying the parameters (and, with `state`, the optimizer state; with `grads`, the
        gradients parked by `stash_grads`) in. Asynchronous on CUDA; call `ready()` before
        computing with the shard."""
        if self.dev is None:
            src = self.offload.host_lp[self.index] if self.offload is not None else self.host
            self.dev = self._copy_in(src, self.param_dtype)
            self.ledger.hold(f"{self.tag}.params", self.numel * self.elt)
        if state and self.state_host and self.state_dev is None:
            self.state_dev = {k: self._copy_in(v, torch.float32) for k, v in self.state_host.items()}
            self.ledger.hold(f"{self.tag}.state", self.numel * 4 * len(self.state_host))
        if grads and self.grad_host is not None and self.dev_grad is None:
            self.dev_grad = self._copy_in(self.grad_host, self.param_dtype)
            self.ledger.hold(f"{self.tag}.grads", self.numel * self.elt)
        if self.copy_stream is not None:
            self._ready_event = torch.cuda.Event()
            self._ready_event.record(self.copy_stream)

    def ready(self) -> None:
        """Make the compute stream wait for the copies in flight, then point the parameters (and
        optimizer state) at the device copies."""
        if self._ready_event is not None:
            compute = torch.cuda.current_stream(self.device)
            compute.wait_event(self._ready_event)
            for t in self._pending:
                t.record_stream(compute)
            self._ready_event = None
        self._pending.clear()
        assert self.dev is not None, f"shard {self.index} is not on the device"
        for p, view in zip(self.params, self.views(self.dev), strict=True):
            p.data = view
        if self.state_dev is not None:
            self._bind_state(self.state_dev)
        if self.dev_grad is not None:
            for p, view in zip(self.params, self.views(self.dev_grad), strict=True):
                p.grad = view

    def _copy_out(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        self.bytes_out += src.numel() * src.element_size()
        if self.copy_stream is None:
            dst.copy_(src)
            return
        # the copy must start after the step that wrote `src`
        self.copy_stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.copy_stream):
            dst.copy_(src, non_blocking=True)
        src.record_stream(self.copy_stream)

    def spill(self) -> None:
        """Write back what changed, free the device copies, point the parameters at the host."""
        self.drop_grads()
        if self.state_dev is not None:
            for k, flat in self.state_dev.items():
                self._copy_out(flat, self.state_host[k])
            self._bind_state(self.state_host)
            self.state_dev = None
            self.ledger.release(f"{self.tag}.state")
        if self.dev is not None:
            if self.dirty:
                self._copy_out(self.dev, self.host)
            self.dirty = False
            for p, view in zip(self.params, self.views(self.host), strict=True):
                p.data = view
            self.dev = None
            self.ledger.release(f"{self.tag}.params")

    # -- compute ----------------------------------------------------------------------------------
    @torch.no_grad()
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Forward without keeping activations: the backward recomputes from the boundary input."""
        return self.layers(x)

    def _alloc_grads(self) -> None:
        if self.dev_grad is None:
            # gradients accumulate in place into views of one flat buffer, so the offloaded
            # optimizer can stream them in buckets and the ledger knows their exact size
            self.dev_grad = torch.zeros(self.numel, dtype=self.param_dtype, device=self.device)
            for p, view in zip(self.params, self.views(self.dev_grad), strict=True):
                p.grad = view
            self.ledger.hold(f"{self.tag}.grads", self.numel * self.elt)

    def stash_grads(self) -> None:
        """Park the gradients in host memory (a deferred step brings them back) and free them."""
        assert self.dev_grad is not None
        if self.grad_host is None:
            self.grad_host = _host_empty(self.numel, self.param_dtype)
        self._copy_out(self.dev_grad, self.grad_host)
        self.drop_grads()

    def drop_grads(self) -> None:
        for p in self.params:
            p.grad = None
        if self.dev_grad is not None:
            self.dev_grad = None
            self.ledger.release(f"{self.tag}.grads")

    def backward(
        self,
        x_in: torch.Tensor,
        *,
        grad_out: torch.Tensor | None = None,
        target: torch.Tensor | None = None,
        loss_scale: float = 1.0,
        loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = lm_loss,
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Recompute the forward from the saved boundary input `x_in`, then backpropagate
        `grad_out` (inner shard) or the loss against `target` (last shard). Returns (gradient of
        the boundary input or None for token ids, the unscaled loss or None)."""
        assert (grad_out is None) != (target is None)
        self._alloc_grads()
        x_in = x_in.detach()
        if x_in.is_floating_point():
            x_in.requires_grad_(True)
        loss = None
        with torch.enable_grad(), SavedActivations(exclude=[self.dev, x_in]) as saved:
            out = self.layers(x_in)
            if target is not None:
                loss = loss_fn(out, target)
                root = loss * loss_scale if loss_scale != 1.0 else loss
            else:
                root = out
        self.ledger.hold(f"{self.tag}.acts", saved.nbytes)
        torch.autograd.backward(root, grad_tensors=grad_out)
        self.ledger.release(f"{self.tag}.acts")
        del out, root
        return (x_in.grad if x_in.requires_grad else None), (None if loss is None else loss.detach())

    def step(self) -> None:
        """Plain-mode optimizer step of this shard's parameters (its state must be resident)."""
        assert self.opt is not None and self.resident
        self.opt.step()
        self.dirty = True

    # -- host view --------------------------------------------------------------------------------
    def master_values(self) -> list[torch.Tensor]:
        """The authoritative fp32 values: the device copy while resident and dirty, else host."""
        if self.dev is not None and self.dirty:
            return [v.detach().float() for v in self.views(self.dev)]
        return self.views(self.host)
