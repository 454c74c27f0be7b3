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


@torch.no_grad()
def grad_sq_sum(params: Iterable[torch.nn.Parameter], *, device: torch.device) -> torch.Tensor:
    """Sum of squared gradients, each tensor counted once per model copy. A tensor-parallel layer
    marks a parameter that several tensor ranks hold identically (trainer/tensor/layers_1d.py's
    convention): `tp_counted` says whether this copy counts; without it every copy weighs
    1/`tp_replicas`."""
    sq = torch.zeros((), dtype=torch.float32, device=device)
    for p in params:
        if p.grad is None or not getattr(p, "tp_counted", True):
            continue
        weight = 1.0 if hasattr(p, "tp_counted") else 1.0 / getattr(p, "tp_replicas", 1)
        sq += p.grad.float().pow(2).sum() * weight
    return sq


@torch.no_grad()
def grad_norm(
    params: Iterable[torch.nn.Parameter], *, group: dist.ProcessGroup | None, device: torch.device
) -> torch.Tensor:
    """Global gradient norm of `params` (one copy of each distinct piece on this rank) summed over
    `group`: the ranks of ONE model replica (pipeline stages x tensor ranks). Summing over WORLD
    would count every data-parallel replica again. A device tensor: no CPU sync here."""
    sq = grad_sq_sum(params, device=device)
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(sq, group=group)
    return sq.sqrt()


def clip_coefficient(norm: torch.Tensor, *, max_norm: float) -> torch.Tensor:
    """torch.nn.utils.clip_grad_norm_'s coefficient, kept on the device."""
    return torch.clamp(max_norm / (norm + 1e-6), max=1.0)
