"""Vocab-parallel cross entropy: the loss of logits split over the vocabulary, without any rank ever
holding a full row of logits.

A rank holds logits_nv: n rows, the v columns [lo, lo + v) of the vocabulary. For each row the
softmax needs the row's max and its sum of exponentials over the whole vocabulary, and the loss needs
the target's logit, which lives on exactly one rank. So, over the ranks that share these rows and
split the vocabulary (`group`):

    m      = max over the group of the local row max            one all-reduce (MAX) of n values
    s, t   = sum over the group of sum(exp(x - m)) and of the    one all-reduce (SUM) of 2n values
             target's x - m (zero on the ranks without it)
    loss_n = log(s) - t

and backward needs no collective at all: d loss_n / d x = softmax(x)[local columns] - onehot(target)
[local columns], from the saved local exponentials and s. The two all-reduces move O(n) values
where gathering the logits would move O(n V).

Which group: 1d splits the vocabulary over the whole axis (every rank holds every row); the grid
splits it over a row's q ranks (`row_peers`: same rows, vocabulary block j).

Under NCCL: every tensor handed to a collective is made from the logits, so it lives on their device;
nothing is read back to the host.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from trainer.tensor import comm
from trainer.tensor.grid import Grid1D, TensorGrid


class _VocabParallelCE(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        logits_nv: torch.Tensor,
        targets_n: torch.Tensor,
        lo: int,
        group: dist.ProcessGroup,
        layer: str,
    ) -> torch.Tensor:
        x_nv = logits_nv.float()
        v = x_nv.shape[-1]
        # the max only keeps exp() in range; it is a constant for the gradient
        m_n = x_nv.detach().amax(dim=-1)
        comm.all_reduce(m_n, group=group, layer=layer, phase="fwd", op=dist.ReduceOp.MAX)
        x_nv = x_nv - m_n.unsqueeze(-1)
        e_nv = torch.exp(x_nv)
        mine_n = (targets_n >= lo) & (targets_n < lo + v)
        local_n = torch.where(mine_n, targets_n - lo, 0)
        target_n = x_nv.gather(-1, local_n.unsqueeze(-1)).squeeze(-1) * mine_n
        stats_2n = torch.stack([e_nv.sum(dim=-1), target_n])
        comm.all_reduce(stats_2n, group=group, layer=layer, phase="fwd")
        sum_n, target_n = stats_2n[0], stats_2n[1]
        ctx.save_for_backward(e_nv, sum_n, local_n, mine_n)
        ctx.dtype = logits_nv.dtype
        return torch.log(sum_n) - target_n

    @staticmethod
    def backward(ctx: Any, grad_n: torch.Tensor) -> tuple[torch.Tensor, None, None, None, None]:
        e_nv, sum_n, local_n, mine_n = ctx.saved_tensors
        g_nv = e_nv / sum_n.unsqueeze(-1)
        g_nv.scatter_add_(-1, local_n.unsqueeze(-1), -mine_n.to(g_nv.dtype).unsqueeze(-1))
        g_nv.mul_(grad_n.unsqueeze(-1))
        return g_nv.to(ctx.dtype), None, None, None, None


def vocab_parallel_cross_entropy(
    logits_BTv: torch.Tensor, targets_BT: torch.Tensor, *, grid: TensorGrid, layer: str = "ce"
) -> torch.Tensor:
    """Per-token cross entropy (B, T) of this rank's rows, from this rank's vocabulary columns.

    The result is the same on every rank that shares these rows (1d: every rank; grid: the row).
    `logits_BTv` are the head's output on this rank: vocabulary block `grid.rank` of `grid.size`
    (1d) or block `grid.j` of `grid.q` (grid), for the rows `local_batch` gives this rank."""
    v = logits_BTv.shape[-1]
    if isinstance(grid, Grid1D):
        lo, group = grid.rank * v, grid.group
    else:
        lo, group = grid.j * v, grid.row_peers
    B, T = targets_BT.shape
    loss_n = _VocabParallelCE.apply(logits_BTv.reshape(B * T, v), targets_BT.reshape(B * T), lo, group, layer)
    return loss_n.view(B, T)


def row_blocks(grid: TensorGrid) -> int:
    """How many equal blocks the batch rows are split into (1d: one, the grid: d*q)."""
    return 1 if isinstance(grid, Grid1D) else grid.d * grid.q


def tp_loss(logits_BTv: torch.Tensor, targets_BT: torch.Tensor, *, grid: TensorGrid) -> torch.Tensor:
    """This rank's share of the dense mean cross entropy: the mean over its rows divided by the
    number of row blocks. Backward from it gives every shard exactly the dense gradient; the sum of
    the shares over the row blocks (`block.global_loss`) is the dense loss."""
    return vocab_parallel_cross_entropy(logits_BTv, targets_BT, grid=grid).mean() / row_blocks(grid)


class VocabParallelLoss:
    """`loss(logits, targets)` for a tensor-parallel model on `grid`: the recipe-style loss callable
    (outputs, targets) -> scalar, where outputs are this rank's vocabulary-split logits and targets
    its rows (`block.local_batch`). See `tp_loss` for what the scalar is."""

    def __init__(self, grid: TensorGrid) -> None:
        self.grid = grid

    def __call__(self, logits_BTv: torch.Tensor, targets_BT: torch.Tensor) -> torch.Tensor:
        return tp_loss(logits_BTv, targets_BT, grid=self.grid)
