"""1-D (Megatron) tensor-parallel versions of the Llama recipe's layers (trainer/llama.py), built
from trainer/tensor/layers_1d.py's column and row linears.

Attention splits query heads and key/value heads in contiguous blocks (rank r holds query heads
r*H/s.. and exactly the key/value heads they read, because H/s is a multiple of H/G); SwiGLU splits
its hidden width (gate and up by column, proj by row); RMSNorm is replicated; the token table and
the output head split the vocabulary (the token table is layers_1d's TokenTable1D, as in GPT's
embedding). Per block: one forward all-reduce per sub-block, and in
backward one all-reduce per column linear's input gradient (q, k, v; gate, up).
2-D and 2.5-D have no Llama form here (refused by jobrules/models.py's tensor_problems).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from trainer.llama import GQAttention, LlamaBlock, LlamaHead, RMSNorm, SwiGLU, TokenEmbedding, attend
from trainer.tensor import comm
from trainer.tensor.grid import Grid1D
from trainer.tensor.layers_1d import ColumnLinear, RowLinear, Slicer, TokenTable1D, param


class RMSNorm1D(nn.Module):
    """Replicated: every rank normalises the full x_BTD."""

    def __init__(self, dense: RMSNorm, *, grid: Grid1D) -> None:
        super().__init__()
        self.eps = dense.eps
        self.weight = param(dense.weight, replicas=grid.size)
        self.slicers: dict[str, Slicer] = {"weight": lambda t: t}

    forward = RMSNorm.forward


class GQAttention1D(nn.Module):
    def __init__(self, dense: GQAttention, *, grid: Grid1D, name: str) -> None:
        super().__init__()
        self.head_dim = dense.head_dim
        self.q = ColumnLinear(dense.q, grid=grid, name=f"{name}.q")
        self.k = ColumnLinear(dense.k, grid=grid, name=f"{name}.k")
        self.v = ColumnLinear(dense.v, grid=grid, name=f"{name}.v")
        self.proj = RowLinear(dense.proj, grid=grid, name=f"{name}.proj")

    def forward(self, x_BTD: torch.Tensor) -> torch.Tensor:
        return self.proj(attend(self.q(x_BTD), self.k(x_BTD), self.v(x_BTD), head_dim=self.head_dim))


class SwiGLU1D(nn.Module):
    def __init__(self, dense: SwiGLU, *, grid: Grid1D, name: str) -> None:
        super().__init__()
        self.gate = ColumnLinear(dense.gate, grid=grid, name=f"{name}.gate")
        self.up = ColumnLinear(dense.up, grid=grid, name=f"{name}.up")
        self.proj = RowLinear(dense.proj, grid=grid, name=f"{name}.proj")

    def forward(self, x_BTD: torch.Tensor) -> torch.Tensor:
        return self.proj(F.silu(self.gate(x_BTD)) * self.up(x_BTD))


class LlamaBlock1D(nn.Module):
    def __init__(self, dense: LlamaBlock, *, grid: Grid1D, name: str) -> None:
        super().__init__()
        self.attn_norm = RMSNorm1D(dense.attn_norm, grid=grid)
        self.attn = GQAttention1D(dense.attn, grid=grid, name=f"{name}.attn")
        self.mlp_norm = RMSNorm1D(dense.mlp_norm, grid=grid)
        self.mlp = SwiGLU1D(dense.mlp, grid=grid, name=f"{name}.mlp")

    forward = LlamaBlock.forward


class TokenEmbedding1D(TokenTable1D):
    """Token table split over the vocabulary (layers_1d's, shared with GPT's embedding)."""

    def __init__(self, dense: TokenEmbedding, *, grid: Grid1D, name: str) -> None:
        super().__init__(dense.tok, grid=grid, name=name)


class LlamaHead1D(nn.Module):
    """Replicated RMSNorm; vocabulary projection split over the vocabulary. Like GPT's Head1D, the
    output is this rank's vocabulary block of the logits (for the vocab-parallel loss) unless
    `gather`, which all-gathers whole rows."""

    def __init__(self, dense: LlamaHead, *, grid: Grid1D, name: str, gather: bool = False) -> None:
        super().__init__()
        self.grid, self.name, self.gather = grid, name, gather
        self.norm = RMSNorm1D(dense.norm, grid=grid)
        self.out = ColumnLinear(dense.out, grid=grid, name=f"{name}.out")

    def forward(self, x_BTD: torch.Tensor) -> torch.Tensor:
        logits_BTv = self.out(self.norm(x_BTD))
        if not self.gather:
            return logits_BTv
        return comm.gather_last(logits_BTv, group=self.grid.group, layer=self.name)


def shard_llama_layer(
    layer: nn.Module, *, grid: object, name: str, gather_logits: bool = False
) -> nn.Module | None:
    """The 1-D version of a Llama layer; None when `layer` is not one."""
    kinds = {TokenEmbedding: TokenEmbedding1D, LlamaBlock: LlamaBlock1D, LlamaHead: LlamaHead1D}
    cls = kinds.get(type(layer))
    if cls is None:
        return None
    if not isinstance(grid, Grid1D):
        raise TypeError(
            f"{type(layer).__name__} has a 1-D tensor-parallel form only (parallel.tensor.mode 1d)"
        )
    if cls is LlamaHead1D:
        return LlamaHead1D(layer, grid=grid, name=name, gather=gather_logits)
    return cls(layer, grid=grid, name=name)
