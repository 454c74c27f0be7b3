"""2.5-D (Tesseract) tensor-parallel layers; 2-D SUMMA is the same code with depth d = 1.

Layout on the d x q x q grid, rank (k, i, j) (see grid.py):
- activations x_BTD: batch rows split over depth and rows (row block r = k*q + i of d*q), hidden
  features split over columns (block j of q): each rank holds x[r, :, j] of shape (B/(dq), T, D/q);
- a linear's weight W (nn.Linear layout, [out, in]): rank holds W[j, i] of shape (out/q, in/q), the
  same block in every depth layer;
- vectors over the hidden dim (biases, layer-norm affine, embedding tables' columns) are split over
  columns and replicated over rows and depth.

Y = X W^T by SUMMA inside each depth layer: at step s the row peers receive X[r, s] from column s
and the column peers receive W[j, s] from row s; step s+1's two broadcasts are issued before step s's
matmul so they travel while it computes. Backward runs the two transposed SUMMAs (broadcast a block,
reduce the partial product onto its owner) and all-reduces weight gradients over depth, because
every depth layer saw different rows against the same weights.

Attention is local: a rank's columns of the fused qkv output are whole heads (heads_grouped), and its
rows are whole sequences (the batch, not the time axis, is split), so softmax needs no collective.
Layer norm needs the mean and variance over all D features: one all-reduce of two numbers per row
over the row peers.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from trainer.models import MLP, Attention, Embedding, Head
from trainer.tensor import comm
from trainer.tensor.grid import TesseractGrid
from trainer.tensor.layers_1d import Slicer, block_of, heads_grouped, local_attention, param


def rows_of(t: torch.Tensor, grid: TesseractGrid) -> torch.Tensor:
    """This rank's rows of a batch-major tensor (inputs, targets, activations)."""
    return block_of(t, dim=0, index=grid.row_block, parts=grid.q * grid.d)


def cols_of(t: torch.Tensor, grid: TesseractGrid) -> torch.Tensor:
    """This rank's block of the last (feature) dim."""
    return block_of(t, dim=-1, index=grid.j, parts=grid.q)


def weight_block(t: torch.Tensor, grid: TesseractGrid) -> torch.Tensor:
    """W[j, i]: output block j, input block i of an nn.Linear weight [out, in]."""
    return block_of(block_of(t, dim=0, index=grid.j, parts=grid.q), dim=1, index=grid.i, parts=grid.q)


class _Summa(torch.autograd.Function):
    """y[r, j] = sum_s x[r, s] W[j, s]^T inside one depth layer, for x_nI = x[r, i'=j] flattened rows."""

    @staticmethod
    def forward(
        ctx: Any, x_nI: torch.Tensor, w_OI: torch.Tensor, grid: TesseractGrid, layer: str
    ) -> torch.Tensor:
        ctx.save_for_backward(x_nI, w_OI)
        ctx.grid, ctx.layer = grid, layer
        y_nO = x_nI.new_zeros(x_nI.shape[0], w_OI.shape[0])
        for _s, a_nI, b_OI in _summa_steps(x_nI, w_OI, grid=grid, layer=layer, phase="fwd"):
            y_nO.addmm_(a_nI, b_OI.t())
        return y_nO

    @staticmethod
    def backward(ctx: Any, dy_nO: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None, None]:
        x_nI, w_OI = ctx.saved_tensors
        grid: TesseractGrid = ctx.grid
        layer = ctx.layer
        dy_nO = dy_nO.contiguous()
        dx_nI, dw_OI = None, None
        pending: list[tuple[Any, torch.Tensor, str, int]] = []
        for s, a_nI, b_OI in _summa_steps(x_nI, w_OI, grid=grid, layer=layer, phase="bwd"):
            # dx[r, s] = sum_j dy[r, j] W[j, s]: partial here, summed onto column s of this row
            pdx_nI = dy_nO @ b_OI
            work = comm.reduce(pdx_nI, dst=grid.row_ranks[s], group=grid.row_peers, layer=layer, phase="bwd")
            pending.append((work, pdx_nI, "x", s))
            # dW[j, s] = sum over this layer's rows of dy[r, j]^T x[r, s]: summed onto row s of this column
            pdw_OI = dy_nO.t() @ a_nI
            work = comm.reduce(pdw_OI, dst=grid.col_ranks[s], group=grid.col_peers, layer=layer, phase="bwd")
            pending.append((work, pdw_OI, "w", s))
        for work, buf, kind, s in pending:
            comm.wait([work])
            if kind == "x" and grid.j == s:
                dx_nI = buf
            if kind == "w" and grid.i == s:
                dw_OI = buf
        assert dx_nI is not None and dw_OI is not None
        # every depth layer multiplied different rows by the same W[j, i]
        comm.all_reduce(dw_OI, group=grid.depth_peers, layer=layer, phase="bwd")
        return dx_nI, dw_OI, None, None


def _summa_steps(
    x_nI: torch.Tensor, w_OI: torch.Tensor, *, grid: TesseractGrid, layer: str, phase: str
) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
    """(s, x[r, s], W[j, s]) for each SUMMA step s, once its broadcasts arrived; step s+1's are
    issued before step s is handed out, so they travel while the caller multiplies."""
    nxt = _fetch(x_nI, w_OI, s=0, grid=grid, layer=layer, phase=phase)
    for s in range(grid.q):
        a_nI, b_OI, works = nxt
        comm.wait(works)
        if s + 1 < grid.q:
            nxt = _fetch(x_nI, w_OI, s=s + 1, grid=grid, layer=layer, phase=phase)
        yield s, a_nI, b_OI


def _fetch(
    x_nI: torch.Tensor, w_OI: torch.Tensor, *, s: int, grid: TesseractGrid, layer: str, phase: str
) -> tuple[torch.Tensor, torch.Tensor, list[Any]]:
    """Start step s's broadcasts: x[r, s] along the row, W[j, s] down the column."""
    a_nI = x_nI if grid.j == s else torch.empty_like(x_nI)
    b_OI = w_OI if grid.i == s else torch.empty_like(w_OI)
    works = [
        comm.broadcast(a_nI, src=grid.row_ranks[s], group=grid.row_peers, layer=layer, phase=phase),
        comm.broadcast(b_OI, src=grid.col_ranks[s], group=grid.col_peers, layer=layer, phase=phase),
    ]
    return a_nI, b_OI, works


class LinearGrid(nn.Module):
    """x[r, :, i] (B/(dq), T, in/q) -> y[r, :, j] (B/(dq), T, out/q), by SUMMA."""

    def __init__(self, dense: nn.Linear, *, grid: TesseractGrid, name: str, qkv: bool = False) -> None:
        super().__init__()
        self.grid, self.name = grid, name

        def cut_w(t: torch.Tensor) -> torch.Tensor:
            return weight_block(heads_grouped(t, groups=grid.q) if qkv else t, grid)

        def cut_b(t: torch.Tensor) -> torch.Tensor:
            return cols_of(heads_grouped(t, groups=grid.q) if qkv else t, grid)

        self.slicers: dict[str, Slicer] = {"weight": cut_w}
        self.weight = param(cut_w(dense.weight), replicas=grid.d, counted=grid.k == 0)
        self.bias = None
        if dense.bias is not None:
            self.slicers["bias"] = cut_b
            self.bias = param(cut_b(dense.bias), replicas=grid.q * grid.d, counted=_counted(grid))

    def forward(self, x_BTI: torch.Tensor) -> torch.Tensor:
        B, T, _ = x_BTI.shape
        y_nO = _Summa.apply(x_BTI.reshape(B * T, -1), self.weight, self.grid, self.name)
        y_BTO = y_nO.view(B, T, -1)
        if self.bias is None:
            return y_BTO
        return y_BTO + _replicated(self.bias, self.grid, self.name)


def _counted(grid: TesseractGrid) -> bool:
    """A column-split vector is replicated over rows and depth: row 0 of layer 0 counts it."""
    return grid.i == 0 and grid.k == 0


def _replicated(w: torch.Tensor, grid: TesseractGrid, layer: str) -> torch.Tensor:
    """A column-split vector shared by the rows and depth layers: gradient summed over both."""
    return comm.grad_sum(w, groups=(grid.col_peers, grid.depth_peers), layer=layer)


class LayerNormGrid(nn.Module):
    def __init__(self, dense: nn.LayerNorm, *, grid: TesseractGrid, name: str) -> None:
        super().__init__()
        self.grid, self.name = grid, name
        self.eps = dense.eps
        self.features = dense.normalized_shape[0]
        cut = lambda t: cols_of(t, grid)  # noqa: E731
        self.slicers: dict[str, Slicer] = {"weight": cut, "bias": cut}
        self.weight = param(cut(dense.weight), replicas=grid.q * grid.d, counted=_counted(grid))
        self.bias = param(cut(dense.bias), replicas=grid.q * grid.d, counted=_counted(grid))

    def forward(self, x_BTc: torch.Tensor) -> torch.Tensor:
        # sum and sum of squares of each row's D features, over the row's q column blocks
        stats_BT2 = torch.stack([x_BTc.sum(-1), (x_BTc * x_BTc).sum(-1)], dim=-1)
        stats_BT2 = comm.sum_over(stats_BT2, group=self.grid.row_peers, layer=self.name)
        mean_BT1 = stats_BT2[..., :1] / self.features
        var_BT1 = stats_BT2[..., 1:] / self.features - mean_BT1 * mean_BT1
        xhat_BTc = (x_BTc - mean_BT1) * torch.rsqrt(var_BT1 + self.eps)
        w = _replicated(self.weight, self.grid, self.name)
        b = _replicated(self.bias, self.grid, self.name)
        return xhat_BTc * w + b


class AttentionGrid(nn.Module):
    def __init__(self, dense: Attention, *, grid: TesseractGrid, name: str) -> None:
        super().__init__()
        self.heads = dense.heads // grid.q
        self.qkv = LinearGrid(dense.qkv, grid=grid, name=f"{name}.qkv", qkv=True)
        self.proj = LinearGrid(dense.proj, grid=grid, name=f"{name}.proj")

    def forward(self, x_BTc: torch.Tensor) -> torch.Tensor:
        return self.proj(local_attention(self.qkv(x_BTc), heads=self.heads))


class MLPGrid(nn.Module):
    def __init__(self, dense: MLP, *, grid: TesseractGrid, name: str) -> None:
        super().__init__()
        self.fc = LinearGrid(dense.fc, grid=grid, name=f"{name}.fc")
        self.proj = LinearGrid(dense.proj, grid=grid, name=f"{name}.proj")

    def forward(self, x_BTc: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x_BTc)))


class EmbeddingGrid(nn.Module):
    """Both tables split over columns: a rank looks up its own rows' ids in its columns, which is
    exactly its block x[r, :, j]; no forward collective. Gradients summed over rows and depth."""

    def __init__(self, dense: Embedding, *, grid: TesseractGrid, name: str) -> None:
        super().__init__()
        self.grid, self.name = grid, name
        cut = lambda t: cols_of(t, grid)  # noqa: E731
        self.tok = nn.Module()
        self.tok.weight = param(cut(dense.tok.weight), replicas=grid.q * grid.d, counted=_counted(grid))
        self.pos = nn.Module()
        self.pos.weight = param(cut(dense.pos.weight), replicas=grid.q * grid.d, counted=_counted(grid))
        self.slicers: dict[str, Slicer] = {"tok.weight": cut, "pos.weight": cut}

    def forward(self, idx_BT: torch.Tensor) -> torch.Tensor:
        tok_Vc = _replicated(self.tok.weight, self.grid, self.name)
        pos_Tc = _replicated(self.pos.weight, self.grid, self.name)
        return F.embedding(idx_BT, tok_Vc) + pos_Tc[: idx_BT.shape[1]]


class HeadGrid(nn.Module):
    """Sharded final norm and vocabulary projection. The output is this rank's block of the logits:
    its rows, vocabulary block j, for cross_entropy.py's vocab-parallel loss; `gather=True`
    all-gathers the row's logits over its columns instead (full-vocabulary logits of its rows)."""

    def __init__(self, dense: Head, *, grid: TesseractGrid, name: str, gather: bool = False) -> None:
        super().__init__()
        self.grid, self.name, self.gather = grid, name, gather
        self.ln = LayerNormGrid(dense.ln, grid=grid, name=f"{name}.ln")
        self.out = LinearGrid(dense.out, grid=grid, name=f"{name}.out")

    def forward(self, x_BTc: torch.Tensor) -> torch.Tensor:
        logits_BTv = self.out(self.ln(x_BTc))
        if not self.gather:
            return logits_BTv
        return comm.gather_last(logits_BTv, group=self.grid.row_peers, layer=self.name)
