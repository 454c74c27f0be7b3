"""1-D (Megatron) tensor-parallel layers: column-parallel then row-parallel linears.

Activations x_BTD are replicated on every rank of the axis. A column-parallel linear splits the
output features (input gradient summed over the axis in backward: Megatron's f); a row-parallel
linear splits the input features and sums its partial outputs (forward all-reduce: Megatron's g).
Attention splits heads, the MLP splits its hidden width, so each sub-block costs one all-reduce of
x_BTD forward and one backward. Layer norms are replicated. The token embedding is split over the
vocabulary (forward all-reduce), the output head over the vocabulary (each rank keeps its vocabulary
block of the logits; cross_entropy.py computes the loss from the blocks).

Every layer keeps `slicers`: for each of its parameters, the function that cuts this rank's shard
out of the dense parameter of the same name (used to build it and, in tests, to compare gradients).
Each parameter carries `tp_replicas`: how many ranks hold an identical copy, and `tp_counted`: whether
this rank's copy is the one counted in a global gradient norm (1d: rank 0's copy of a replicated one).

Shape suffixes: B batch, T time, D d_model, O/I output/input features, V vocabulary; a lowercase
letter is this rank's shard of that dim.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from trainer.models import MLP, Attention, Embedding, Head
from trainer.tensor import comm
from trainer.tensor.grid import Grid1D

Slicer = Callable[[torch.Tensor], torch.Tensor]


def param(t: torch.Tensor, *, replicas: int, counted: bool | None = None) -> nn.Parameter:
    """A shard as a parameter. `replicas`: how many ranks of the tensor grid hold an identical copy
    (gradients included); `counted`: whether this rank's copy is the one a global gradient norm
    counts (exactly one copy of each replicated parameter is). Left out, a norm weighs each copy
    by 1/replicas instead (the same sum, up to rounding)."""
    p = nn.Parameter(t.detach().clone().contiguous())
    p.tp_replicas = replicas  # type: ignore[attr-defined]
    if counted is not None or replicas == 1:
        p.tp_counted = True if counted is None else counted  # type: ignore[attr-defined]
    return p


def block_of(t: torch.Tensor, *, dim: int, index: int, parts: int) -> torch.Tensor:
    """The `index`-th of `parts` equal slices of `t` along `dim`."""
    n = t.shape[dim]
    assert n % parts == 0, f"dim {dim} of size {n} does not split into {parts}"
    return t.narrow(dim, index * (n // parts), n // parts)


def heads_grouped(t: torch.Tensor, *, groups: int) -> torch.Tensor:
    """Reorder a fused qkv weight/bias [3D, ...] so that slice g of `groups` holds q, k and v of the
    g-th group of heads: a rank's output features are then whole heads it can attend with alone."""
    three_d = t.shape[0]
    d = three_d // 3
    return t.reshape(3, groups, d // groups, *t.shape[1:]).transpose(0, 1).reshape(three_d, *t.shape[1:])


def local_attention(qkv_BTc: torch.Tensor, *, heads: int) -> torch.Tensor:
    """Causal attention over this rank's heads: qkv holds [q | k | v] of `heads` whole heads."""
    B, T, three_c = qkv_BTc.shape
    c = three_c // 3
    q, k, v = (t.view(B, T, heads, c // heads).transpose(1, 2) for t in qkv_BTc.split(c, dim=-1))
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return y.transpose(1, 2).reshape(B, T, c)


class ColumnLinear(nn.Module):
    """y_BTo = x_BTI W[o, :]^T + b[o]: output features split; x replicated."""

    def __init__(self, dense: nn.Linear, *, grid: Grid1D, name: str, qkv: bool = False) -> None:
        super().__init__()
        self.grid, self.name = grid, name

        def cut(t: torch.Tensor) -> torch.Tensor:
            t = heads_grouped(t, groups=grid.size) if qkv else t
            return block_of(t, dim=0, index=grid.rank, parts=grid.size)

        self.slicers: dict[str, Slicer] = {"weight": cut}
        self.weight = param(cut(dense.weight), replicas=1)
        self.bias = None
        if dense.bias is not None:
            self.slicers["bias"] = cut
            self.bias = param(cut(dense.bias), replicas=1)

    def forward(self, x_BTI: torch.Tensor) -> torch.Tensor:
        x_BTI = comm.copy_to(x_BTI, group=self.grid.group, layer=self.name)
        return F.linear(x_BTI, self.weight, self.bias)


class RowLinear(nn.Module):
    """y_BTO = sum over ranks of x_BTi W[:, i]^T, then + b: input features split; y replicated."""

    def __init__(self, dense: nn.Linear, *, grid: Grid1D, name: str) -> None:
        super().__init__()
        self.grid, self.name = grid, name

        def cut(t: torch.Tensor) -> torch.Tensor:
            return block_of(t, dim=1, index=grid.rank, parts=grid.size)

        self.slicers: dict[str, Slicer] = {"weight": cut}
        self.weight = param(cut(dense.weight), replicas=1)
        self.bias = None
        if dense.bias is not None:
            self.slicers["bias"] = lambda t: t
            self.bias = param(dense.bias, replicas=grid.size, counted=grid.rank == 0)

    def forward(self, x_BTi: torch.Tensor) -> torch.Tensor:
        y_BTO = comm.reduce_from(F.linear(x_BTi, self.weight), group=self.grid.group, layer=self.name)
        # note: bias after the all-reduce, or it would be added once per rank
        return y_BTO if self.bias is None else y_BTO + self.bias


class LayerNorm1D(nn.LayerNorm):
    """Replicated: every rank normalises the full x_BTD itself (cheaper than any collective)."""

    def __init__(self, dense: nn.LayerNorm, *, grid: Grid1D, name: str) -> None:
        super().__init__(dense.normalized_shape, eps=dense.eps)
        self.name = name
        self.slicers: dict[str, Slicer] = {"weight": lambda t: t, "bias": lambda t: t}
        self.weight = param(dense.weight, replicas=grid.size, counted=grid.rank == 0)
        self.bias = param(dense.bias, replicas=grid.size, counted=grid.rank == 0)


class Attention1D(nn.Module):
    def __init__(self, dense: Attention, *, grid: Grid1D, name: str) -> None:
        super().__init__()
        self.heads = dense.heads // grid.size
        self.qkv = ColumnLinear(dense.qkv, grid=grid, name=f"{name}.qkv", qkv=True)
        self.proj = RowLinear(dense.proj, grid=grid, name=f"{name}.proj")

    def forward(self, x_BTD: torch.Tensor) -> torch.Tensor:
        return self.proj(local_attention(self.qkv(x_BTD), heads=self.heads))


class MLP1D(nn.Module):
    def __init__(self, dense: MLP, *, grid: Grid1D, name: str) -> None:
        super().__init__()
        self.fc = ColumnLinear(dense.fc, grid=grid, name=f"{name}.fc")
        self.proj = RowLinear(dense.proj, grid=grid, name=f"{name}.proj")

    def forward(self, x_BTD: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x_BTD)))


class TokenTable1D(nn.Module):
    """Token table split over the vocabulary: each rank looks up the ids it owns, zeros for the rest,
    and one all-reduce assembles x_BTD. GPT's Embedding1D adds its position table; the Llama
    recipe's token embedding is this alone (trainer/tensor/llama_1d.py)."""

    def __init__(self, tok: nn.Embedding, *, grid: Grid1D, name: str) -> None:
        super().__init__()
        self.grid, self.name = grid, name
        vocab = tok.weight.shape[0]
        self.lo, self.hi = grid.rank * vocab // grid.size, (grid.rank + 1) * vocab // grid.size

        def cut(t: torch.Tensor) -> torch.Tensor:
            return block_of(t, dim=0, index=grid.rank, parts=grid.size)

        self.tok = nn.Module()
        self.tok.weight = param(cut(tok.weight), replicas=1)
        self.slicers: dict[str, Slicer] = {"tok.weight": cut}

    def forward(self, idx_BT: torch.Tensor) -> torch.Tensor:
        mine_BT = (idx_BT >= self.lo) & (idx_BT < self.hi)
        local_BT = torch.where(mine_BT, idx_BT - self.lo, 0)
        x_BTD = F.embedding(local_BT, self.tok.weight) * mine_BT.unsqueeze(-1)
        return comm.reduce_from(x_BTD, group=self.grid.group, layer=self.name)


class Embedding1D(TokenTable1D):
    """GPT's embedding: the vocabulary-split token table plus a replicated position table."""

    def __init__(self, dense: Embedding, *, grid: Grid1D, name: str) -> None:
        super().__init__(dense.tok, grid=grid, name=name)
        self.pos = nn.Module()
        self.pos.weight = param(dense.pos.weight, replicas=grid.size, counted=grid.rank == 0)
        self.slicers["pos.weight"] = lambda t: t

    def forward(self, idx_BT: torch.Tensor) -> torch.Tensor:
        return super().forward(idx_BT) + self.pos.weight[: idx_BT.shape[1]]


class Head1D(nn.Module):
    """Replicated final norm; vocabulary projection split over the vocabulary. The output is this
    rank's vocabulary block of the logits (block `grid.rank`), for cross_entropy.py's
    vocab-parallel loss; `gather=True` all-gathers the full logits instead (for a consumer that
    needs whole rows, e.g. a loss computed on dense logits)."""

    def __init__(self, dense: Head, *, grid: Grid1D, name: str, gather: bool = False) -> None:
        super().__init__()
        self.grid, self.name, self.gather = grid, name, gather
        self.ln = LayerNorm1D(dense.ln, grid=grid, name=f"{name}.ln")
        self.out = ColumnLinear(dense.out, grid=grid, name=f"{name}.out")

    def forward(self, x_BTD: torch.Tensor) -> torch.Tensor:
        logits_BTv = self.out(self.ln(x_BTD))
        if not self.gather:
            return logits_BTv
        return comm.gather_last(logits_BTv, group=self.grid.group, layer=self.name)
