"""The one module through which tensor-parallel layers issue collectives, and the ledger that
counts every one of them (calls, payload bytes and bytes sent, per rank, per layer, per phase).

What is measured and what is modelled. `calls` and `payload` are read off each call: payload is the
bytes of the tensor this rank hands to the collective. `sent` is what this rank puts on the wire
for that call under the textbook algorithm for the op (the bandwidth term of the alpha-beta model):

    all_reduce  ring (reduce-scatter + all-gather)   2(p-1)/p * payload
    all_gather  ring                                 (p-1) * payload          (payload = my block)
    broadcast   flat tree (root sends to each peer)  root: (p-1) * payload, others: 0
    reduce      flat tree (each peer sends to root)  root: 0, others: payload

gloo's broadcast is a binomial tree: a call still moves (p-1) x payload in all, but inner nodes
forward part of it. SUMMA rotates the root through the group, so over a full SUMMA every rank holds
every position of the tree once and its total is (p-1) x payload per broadcast family either way;
the ledger books each call's bytes at the root. In any tree reduce every non-root sends its (partial)
sum exactly once, so the reduce model holds call by call. Collectives over a group of one rank are
not issued and not counted.
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

import torch
import torch.distributed as dist


@dataclass(slots=True)
class Count:
    calls: int = 0
    payload: int = 0
    """Bytes of the tensors handed to the collectives."""
    sent: Fraction = Fraction(0)
    """Bytes this rank sends under the algorithm model in the module docstring."""

    def add(self, other: Count) -> None:
        self.calls += other.calls
        self.payload += other.payload
        self.sent += other.sent

    def as_dict(self) -> dict[str, Any]:
        sent = int(self.sent) if self.sent.denominator == 1 else float(self.sent)
        return {"calls": self.calls, "payload_bytes": self.payload, "sent_bytes": sent}


@dataclass(slots=True)
class CommLedger:
    """This process's record, keyed by (layer, phase, op). One ledger per process = per rank."""

    enabled: bool = True
    records: dict[tuple[str, str, str], Count] = field(default_factory=lambda: defaultdict(Count))

    def record(self, *, layer: str, phase: str, op: str, payload: int, sent: Fraction) -> None:
        if not self.enabled:
            return
        c = self.records[(layer, phase, op)]
        c.calls += 1
        c.payload += payload
        c.sent += sent

    def reset(self) -> None:
        self.records = defaultdict(Count)

    def total(
        self, *, layer: str | None = None, phase: str | None = None, prefix: str | None = None
    ) -> Count:
        out = Count()
        for (lay, ph, _), c in self.records.items():
            if layer is not None and lay != layer:
                continue
            if prefix is not None and not lay.startswith(prefix):
                continue
            if phase is not None and ph != phase:
                continue
            out.add(c)
        return out

    def by_layer(self) -> dict[str, dict[str, dict[str, Any]]]:
        """{layer: {phase: counts}} (plain dicts, for JSON and for sending between processes)."""
        out: dict[str, dict[str, Count]] = defaultdict(lambda: defaultdict(Count))
        for (lay, ph, _), c in self.records.items():
            out[lay][ph].add(c)
        return {lay: {ph: c.as_dict() for ph, c in phases.items()} for lay, phases in out.items()}

    def by_op(self) -> dict[str, dict[str, Any]]:
        out: dict[str, Count] = defaultdict(Count)
        for (_, ph, op), c in self.records.items():
            out[f"{ph}.{op}"].add(c)
        return {k: c.as_dict() for k, c in sorted(out.items())}


LEDGER = CommLedger()


@contextlib.contextmanager
def paused() -> Iterator[None]:
    """Leave these collectives out of the ledger (evaluation, loss reporting)."""
    was = LEDGER.enabled
    LEDGER.enabled = False
    try:
        yield
    finally:
        LEDGER.enabled = was


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _size(group: dist.ProcessGroup) -> int:
    return dist.get_world_size(group)


# ---- raw collectives (no autograd); every call is counted --------------------------------------


def all_reduce(
    t: torch.Tensor,
    *,
    group: dist.ProcessGroup,
    layer: str,
    phase: str,
    op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM,
) -> torch.Tensor:
    """Reduce `t` in place over `group` (a sum unless `op` says otherwise; the cost is the same)."""
    p = _size(group)
    if p == 1:
        return t
    n = _nbytes(t)
    LEDGER.record(layer=layer, phase=phase, op="all_reduce", payload=n, sent=Fraction(2 * (p - 1) * n, p))
    dist.all_reduce(t, op=op, group=group)
    return t


def broadcast(
    t: torch.Tensor, *, src: int, group: dist.ProcessGroup, layer: str, phase: str
) -> dist.Work | None:
    """Asynchronous broadcast from global rank `src`; the caller waits on the returned work."""
    p = _size(group)
    if p == 1:
        return None
    n = _nbytes(t)
    sent = Fraction((p - 1) * n) if dist.get_rank() == src else Fraction(0)
    LEDGER.record(layer=layer, phase=phase, op="broadcast", payload=n, sent=sent)
    return dist.broadcast(t, src=src, group=group, async_op=True)


def reduce(
    t: torch.Tensor, *, dst: int, group: dist.ProcessGroup, layer: str, phase: str
) -> dist.Work | None:
    """Asynchronous sum onto global rank `dst` (other ranks' `t` is scratch afterwards)."""
    p = _size(group)
    if p == 1:
        return None
    n = _nbytes(t)
    sent = Fraction(0) if dist.get_rank() == dst else Fraction(n)
    LEDGER.record(layer=layer, phase=phase, op="reduce", payload=n, sent=sent)
    return dist.reduce(t, dst=dst, group=group, async_op=True)


def all_gather_last(t: torch.Tensor, *, group: dist.ProcessGroup, layer: str, phase: str) -> torch.Tensor:
    """Concatenate every rank's `t` along the last dim, in group-rank order."""
    p = _size(group)
    if p == 1:
        return t
    t = t.contiguous()
    n = _nbytes(t)
    LEDGER.record(layer=layer, phase=phase, op="all_gather", payload=n, sent=Fraction((p - 1) * n))
    parts = [torch.empty_like(t) for _ in range(p)]
    dist.all_gather(parts, t, group=group)
    return torch.cat(parts, dim=-1)


def wait(works: Sequence[dist.Work | None]) -> None:
    for w in works:
        if w is not None:
            w.wait()


# ---- autograd-aware collectives ---------------------------------------------------------------


class _CopyToGroup(torch.autograd.Function):
    """Megatron's f: identity forward; the input's gradient is summed over the group."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup, layer: str) -> torch.Tensor:
        ctx.group, ctx.layer = group, layer
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return all_reduce(g.contiguous().clone(), group=ctx.group, layer=ctx.layer, phase="bwd"), None, None


class _ReduceFromGroup(torch.autograd.Function):
    """Megatron's g: sum partial outputs forward; the gradient passes through unchanged."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup, layer: str) -> torch.Tensor:
        return all_reduce(x.contiguous().clone(), group=group, layer=layer, phase="fwd")

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return g, None, None


class _SumOverGroup(torch.autograd.Function):
    """All-reduce whose result every rank goes on to use differently (layer-norm statistics):
    the gradient of the input is the sum over the group of the gradients of the result."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup, layer: str) -> torch.Tensor:
        ctx.group, ctx.layer = group, layer
        return all_reduce(x.contiguous().clone(), group=group, layer=layer, phase="fwd")

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return all_reduce(g.contiguous().clone(), group=ctx.group, layer=ctx.layer, phase="bwd"), None, None


class _GatherLast(torch.autograd.Function):
    """All-gather along the last dim into a replicated tensor; backward keeps this rank's slice
    (every rank computes the same thing from the gathered copy, so its gradient is not summed)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup, layer: str) -> torch.Tensor:
        ctx.rank, ctx.width = dist.get_rank(group), x.shape[-1]
        return all_gather_last(x, group=group, layer=layer, phase="fwd")

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        w = ctx.width
        return g[..., ctx.rank * w : (ctx.rank + 1) * w].contiguous(), None, None


class _GradSum(torch.autograd.Function):
    """Identity on a replicated parameter; its gradient is all-reduced over each group in turn, so
    every replica holds the full gradient and takes the same optimizer step."""

    @staticmethod
    def forward(ctx: Any, w: torch.Tensor, groups: tuple[dist.ProcessGroup, ...], layer: str) -> torch.Tensor:
        ctx.groups, ctx.layer = groups, layer
        return w.view_as(w)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        g = g.contiguous().clone()
        for group in ctx.groups:
            all_reduce(g, group=group, layer=ctx.layer, phase="bwd")
        return g, None, None


def copy_to(x: torch.Tensor, *, group: dist.ProcessGroup, layer: str) -> torch.Tensor:
    return _CopyToGroup.apply(x, group, layer)


def reduce_from(x: torch.Tensor, *, group: dist.ProcessGroup, layer: str) -> torch.Tensor:
    return _ReduceFromGroup.apply(x, group, layer)


def sum_over(x: torch.Tensor, *, group: dist.ProcessGroup, layer: str) -> torch.Tensor:
    return _SumOverGroup.apply(x, group, layer)


def gather_last(x: torch.Tensor, *, group: dist.ProcessGroup, layer: str) -> torch.Tensor:
    return _GatherLast.apply(x, group, layer)


def grad_sum(w: torch.Tensor, *, groups: tuple[dist.ProcessGroup, ...], layer: str) -> torch.Tensor:
    if all(_size(g) == 1 for g in groups):
        return w
    return _GradSum.apply(w, groups, layer)
