"""A spilled shard's optimizer kept and stepped in host memory (`parallel.spill.optimizer: "host"`).

With the state on the device (the default), a spilled shard's fp32 weights and Adam moments cross
the link in and out at every step: about 24 bytes a parameter, and at PCIe speeds that costs more
than the shard's compute (docs/gpu.md). Here only what must cross does: the weights come in for the
forward and the recompute, and the gradients go out, 4 bytes a parameter each way. The moments stay
in host memory, and the CPU steps the shard (torch's fused AdamW or SGD, many threads) in a thread
of its own while the device goes on with the backward of the shards before it. ZeRO-Offload's
CPU-Adam, applied to HYDRA's shards.

A shard's step starts as soon as its backward is done:

    device  ... backward k | backward k-1 | ...
    d2h             grad k, chunk 0, 1, ... (a copy stream of its own, one event per chunk)
    host                  step chunk 0 when its event fires, chunk 1, ...   -> future k

and a shard is copied in again only once its future is done (`wait`). The chunks let the CPU start
on the first parameters while the rest of the gradient is still crossing. The host copy of the
weights (`Shard.host`) is the truth and is written by the step alone, so the device copy is never
newer (a spill writes nothing back).

The step is exact: the same torch optimizer over the same fp32 values, run on the host. On CPU it is
bit for bit the resident run of `torch.optim.AdamW(fused=True)` (tests/trainer/test_spill_host.py).
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from jobrules.spec import TrainSpec
from trainer.spill.shard import Shard, _host_empty

CHUNK_NUMEL = 4 * 2**20
"""Parameters per chunk of a shard's gradient copy and step (16 MiB of fp32): large enough that a
chunk's copy runs at the link's speed, small enough that the CPU starts early."""


def host_optimizer(params: list[torch.Tensor], cfg: TrainSpec) -> torch.optim.Optimizer:
    """torch's fused CPU kernel: several times faster than the per-tensor loop on a many-core host."""
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(
            params, lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay, fused=True
        )
    return torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay, fused=True)


def state_keys(cfg: TrainSpec) -> list[str]:
    if cfg.optimizer == "adamw":
        return ["exp_avg", "exp_avg_sq"]
    return ["momentum_buffer"] if cfg.momentum > 0 else []


class _Chunk:
    """Consecutive parameters of one shard, stepped together by one optimizer."""

    def __init__(self, *, first: int, stop: int, start_el: int, stop_el: int, opt: torch.optim.Optimizer):
        self.first, self.stop = first, stop  # parameter indices [first, stop)
        self.start_el, self.stop_el = start_el, stop_el  # element range in the flat buffers
        self.opt = opt


class HostSteps:
    """The host-side optimizers of the shards in `shards` (the engine's spilled ones)."""

    def __init__(self, shards: list[Shard], *, train: TrainSpec, device: torch.device) -> None:
        self.train, self.device = train, device
        self.keys = state_keys(train)
        self.d2h = torch.cuda.Stream(device) if device.type == "cuda" else None
        # one worker: the steps run in the order the backward hands them over, and the fused
        # kernels spread each over the host's cores themselves
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="spill-host-step")
        self.pending: dict[int, Future[None]] = {}
        self.grads: dict[int, torch.Tensor] = {}
        self.leaves: dict[int, list[torch.Tensor]] = {}
        self.chunks: dict[int, list[_Chunk]] = {}
        for s in shards:
            self._adopt(s)

    def _adopt(self, s: Shard) -> None:
        grad = _host_empty(s.numel, torch.float32)
        # leaves over the shard's host copy: the parameters' own `.data` moves to the device and
        # back, these stay on the host copy the step writes
        leaves = [v.detach() for v in s.views(s.host)]
        for leaf, g in zip(leaves, s.views(grad), strict=True):
            leaf.grad = g
        chunks: list[_Chunk] = []
        first = 0
        while first < len(leaves):
            stop, size = first, 0
            while stop < len(leaves) and (stop == first or size + leaves[stop].numel() <= CHUNK_NUMEL):
                size += leaves[stop].numel()
                stop += 1
            opt = host_optimizer(leaves[first:stop], self.train)
            start_el = s.offsets[first]
            chunks.append(_Chunk(first=first, stop=stop, start_el=start_el, stop_el=start_el + size, opt=opt))
            first = stop
        # the state exists from the start (zeros give torch's first step), so that a checkpoint
        # taken before any step, and a restore, see every key
        for c in chunks:
            for leaf in leaves[c.first : c.stop]:
                st = c.opt.state[leaf]
                for k in self.keys:
                    st[k] = torch.zeros_like(leaf)
                if self.train.optimizer == "adamw":
                    st["step"] = torch.tensor(0.0, dtype=torch.float32)
        self.grads[s.index], self.leaves[s.index], self.chunks[s.index] = grad, leaves, chunks

    # -- the step -----------------------------------------------------------------------------------
    def copy_out(self, s: Shard) -> list[torch.cuda.Event | None]:
        """Start copying shard `s`'s device gradient to host, a chunk at a time; the events say when
        each chunk has arrived (None: already there, off CUDA)."""
        assert s.dev_grad is not None
        host = self.grads[s.index]
        s.bytes_out += host.numel() * host.element_size()
        if self.d2h is None:
            host.copy_(s.dev_grad)
            return [None] * len(self.chunks[s.index])
        self.d2h.wait_stream(torch.cuda.current_stream(self.device))  # the backward wrote it
        events: list[torch.cuda.Event | None] = []
        with torch.cuda.stream(self.d2h):
            for c in self.chunks[s.index]:
                host[c.start_el : c.stop_el].copy_(s.dev_grad[c.start_el : c.stop_el], non_blocking=True)
                ev = torch.cuda.Event()
                ev.record(self.d2h)
                events.append(ev)
        # the caching allocator must not hand the gradient's memory out before the copy has run
        s.dev_grad.record_stream(self.d2h)
        return events

    def launch(
        self,
        s: Shard,
        *,
        events: list[torch.cuda.Event | None] | None = None,
        coef: torch.Tensor | None = None,
    ) -> None:
        """Step shard `s` in the worker once its gradient is in host memory (`events`, from
        `copy_out`; None: it is there already). `coef` scales the gradient first (global-norm
        clipping, decided once every gradient was in)."""
        assert s.index not in self.pending, f"shard {s.index} is still stepping"
        chunks = self.chunks[s.index]
        evs = events if events is not None else [None] * len(chunks)
        grads = s.views(self.grads[s.index])
        mult = None if coef is None else coef.detach().to("cpu", torch.float32)

        def run() -> None:
            for c, ev in zip(chunks, evs, strict=True):
                if ev is not None:
                    ev.synchronize()
                if mult is not None:
                    for g in grads[c.first : c.stop]:
                        g.mul_(mult)
                c.opt.step()

        self.pending[s.index] = self.pool.submit(run)

    def done(self, index: int) -> bool:
        """Whether shard `index` has no step in flight (its host copy is current)."""
        fut = self.pending.get(index)
        return fut is None or fut.done()

    def wait(self, index: int) -> None:
        """Block until shard `index`'s step is done (its host copy is then current)."""
        fut = self.pending.pop(index, None)
        if fut is not None:
            fut.result()  # a failure in the step is raised here, in the training thread

    def wait_all(self) -> None:
        for index in list(self.pending):
            self.wait(index)
        if self.d2h is not None:
            self.d2h.synchronize()

    def close(self) -> None:
        self.wait_all()
        self.pool.shutdown(wait=True)

    # -- checkpoints ----------------------------------------------------------------------------------
    def state_by_name(self, s: Shard) -> dict[str, dict[str, Any]]:
        self.wait(s.index)
        out: dict[str, dict[str, Any]] = {}
        leaves = self.leaves[s.index]
        for c in self.chunks[s.index]:
            for i in range(c.first, c.stop):
                st = c.opt.state[leaves[i]]
                entry: dict[str, Any] = {k: st[k].reshape(-1).clone() for k in self.keys}
                if "step" in st:
                    entry["step"] = float(st["step"])
                out[s.names[i]] = entry
        return out

    def load_by_name(self, s: Shard, per_param: dict[str, dict[str, Any]]) -> None:
        self.wait(s.index)
        leaves = self.leaves[s.index]
        for c in self.chunks[s.index]:
            for i in range(c.first, c.stop):
                st, saved = c.opt.state[leaves[i]], per_param[s.names[i]]
                for k in self.keys:
                    st[k].copy_(saved[k].reshape(st[k].shape))
                if "step" in st:
                    st["step"].fill_(float(saved["step"]))
