"""Gradient plumbing shared by every composed engine: a data-parallel replica's rows, the once-per-
step bucketed gradient all-reduce over the data-parallel group, and global-norm clipping summed over
exactly the ranks that hold distinct pieces of one model copy.

NCCL rules kept here (gloo tests cannot catch a breach, so they are rules, not luck): every
collective is on tensors of the gradients' own device, every rank of a group issues the same
collectives in the same order with the same sizes, and nothing waits on the CPU for a result that
is only needed on the device (the clip coefficient stays a device tensor).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
import torch.distributed as dist

BUCKET_BYTES = 25 * 2**20
"""All-reduce bucket size (as DDP's default): big enough to amortise a collective's latency, small
enough that the flat copy is a small fraction of the gradients."""


def replica_rows(t: torch.Tensor, *, index: int, replicas: int) -> torch.Tensor:
    """Replica `index`'s contiguous block of a global batch's rows (jobrules checks divisibility)."""
    if replicas == 1:
        return t
    rows = t.shape[0] // replicas
    return t[index * rows : (index + 1) * rows]


def _buckets(tensors: Sequence[torch.Tensor], bucket_bytes: int) -> Iterable[list[torch.Tensor]]:
    bucket: list[torch.Tensor] = []
    size = 0
    for t in tensors:
        nbytes = t.numel() * 4
        if bucket and (size + nbytes > bucket_bytes or t.device != bucket[0].device):
            yield bucket
            bucket, size = [], 0
        bucket.append(t)
        size += nbytes
    if bucket:
        yield bucket


@torch.no_grad()
def average_gradients(
    params: Sequence[torch.nn.Parameter], *, group: dist.ProcessGroup | None, bucket_bytes: int = BUCKET_BYTES
) -> int:
    """Mean of every parameter's gradient over `group` (the data-parallel replicas), in fp32
    buckets; a missing gradient counts as zeros so every replica issues the same collectives.
    Returns the number of all-reduce calls (one per bucket)."""
    if group is None or dist.get_world_size(group) == 1:
        return 0
    n = dist.get_world_size(group)
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    calls = 0
    for bucket in _buckets([p.grad for p in params], bucket_bytes):
        flat = torch.cat([g.reshape(-1).float() for g in bucket])
        dist.all_reduce(flat, group=group)
        flat.div_(n)
        offset = 0
        for g in bucket:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()
        calls += 1
    return calls


def _weight(p: torch.nn.Parameter) -> float:
    """How much this rank's copy of `p` counts toward one model copy's norm (the tensor layers'
    convention, trainer/tensor/layers_1d.py): a parameter that several tensor ranks hold
    identically either says with `tp_counted` whether this copy counts (1 or 0), or, without it,
    weighs 1/`tp_replicas` on every rank holding it."""
    if hasattr(p, "tp_counted"):
        return 1.0 if p.tp_counted else 0.0
    return 1.0 / getattr(p, "tp_replicas", 1)


@torch.no_grad()
def grad_norm(
    params: Iterable[torch.nn.Parameter],
    *,
    groups: Sequence[dist.ProcessGroup | None] = (),
    device: torch.device | None = None,
) -> torch.Tensor:
    """Global 2-norm of one model copy's gradient, as torch.nn.utils.clip_grad_norm_ computes it
    for the dense model (per-parameter norms first), from the pieces on this rank.

    Each rank sums the squares of the pieces it counts (`_weight`), then the sum is all-reduced
    over each of `groups` in turn: together they must span exactly the ranks that hold distinct
    pieces of ONE model copy (pipeline stages x tensor ranks; a 2.5d grid is three groups). A
    data-parallel group must never be among them: its replicas hold the same averaged gradients,
    and summing them would count the model several times.

    Returns a 0-d float32 tensor on the gradients' device (`device` when no gradient exists yet).
    Nothing is read back to the host and no CPU tensor enters a collective (NCCL-safe, no sync);
    the weights are Python scalars, so no host-to-device copy either."""
    params = list(params)
    if device is None:
        device = next((p.grad.device for p in params if p.grad is not None), params[0].device)
    squares = []
    for p in params:
        if p.grad is not None and (w := _weight(p)) > 0.0:
            s = torch.linalg.vector_norm(p.grad, 2.0, dtype=torch.float32).square()
            squares.append(s if w == 1.0 else s * w)
    sq = torch.zeros((), dtype=torch.float32, device=device)
    if squares:
        sq += torch.stack(squares).sum()
    for group in groups:
        if group is not None and dist.get_world_size(group) > 1:
            dist.all_reduce(sq, group=group)
    return sq.sqrt()


def clip_coefficient(norm: torch.Tensor, *, max_norm: float) -> torch.Tensor:
    """torch.nn.utils.clip_grad_norm_'s coefficient, kept on the device."""
    return torch.clamp(max_norm / (norm + 1e-6), max=1.0)


@torch.no_grad()
def clip_grad_norm_(
    params: Iterable[torch.nn.Parameter],
    *,
    max_norm: float,
    groups: Sequence[dist.ProcessGroup | None] = (),
    device: torch.device | None = None,
) -> torch.Tensor:
    """torch.nn.utils.clip_grad_norm_ over a model split across ranks: `grad_norm`, then every
    gradient on this rank scaled in place by the coefficient (`scale_grads_`). Returns the norm."""
    params = list(params)
    norm = grad_norm(params, groups=groups, device=device)
    scale_grads_(params, clip_coefficient(norm, max_norm=max_norm))
    return norm


@torch.no_grad()
def scale_grads_(params: Iterable[torch.nn.Parameter], coef: torch.Tensor) -> None:
    """Every gradient of `params` times `coef`, in place; `coef` stays a device tensor (no sync).
    How a clip coefficient is applied, here and by the composed engine's optimizer step."""
    for p in params:
        if p.grad is not None:
            p.grad.mul_(coef.to(p.grad.dtype))
