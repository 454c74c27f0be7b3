"""Dense GPT layers -> their tensor-parallel versions for a grid, plus the pieces a training step
needs around them: this rank's share of a batch, the loss, and the shard of any dense tensor.

A sharded model keeps the dense model's parameter names (`1.attn.qkv.weight`, ...), so a test or a
checkpoint can match every shard to the dense parameter it was cut from.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
import torch.distributed as dist
from torch import nn

from trainer.grads import clip_grad_norm_
from trainer.models import Block, Embedding, Head
from trainer.tensor import comm, layers_1d, layers_25d
from trainer.tensor.cross_entropy import row_blocks, tp_loss
from trainer.tensor.grid import Grid1D, TensorGrid, TesseractGrid
from trainer.tensor.layers_1d import Slicer
from trainer.tensor.llama_1d import shard_llama_layer


class BlockTP(nn.Module):
    """Pre-norm block with the dense Block's forward; only the layers inside are sharded."""

    def __init__(self, *, ln1: nn.Module, attn: nn.Module, ln2: nn.Module, mlp: nn.Module) -> None:
        super().__init__()
        self.ln1, self.attn, self.ln2, self.mlp = ln1, attn, ln2, mlp

    def forward(self, x_BTD: torch.Tensor) -> torch.Tensor:
        x_BTD = x_BTD + self.attn(self.ln1(x_BTD))
        return x_BTD + self.mlp(self.ln2(x_BTD))


def shard_block(block: Block, *, grid: TensorGrid, name: str) -> BlockTP:
    if isinstance(grid, Grid1D):
        ln, attn, mlp = layers_1d.LayerNorm1D, layers_1d.Attention1D, layers_1d.MLP1D
    else:
        ln, attn, mlp = layers_25d.LayerNormGrid, layers_25d.AttentionGrid, layers_25d.MLPGrid
    return BlockTP(
        ln1=ln(block.ln1, grid=grid, name=f"{name}.ln1"),
        attn=attn(block.attn, grid=grid, name=f"{name}.attn"),
        ln2=ln(block.ln2, grid=grid, name=f"{name}.ln2"),
        mlp=mlp(block.mlp, grid=grid, name=f"{name}.mlp"),
    )


def shard_layer(layer: nn.Module, *, grid: TensorGrid, name: str, gather_logits: bool = False) -> nn.Module:
    """One layer of a GPT (embedding, block or head) or a Llama (1d). The head's output is this
    rank's vocabulary block of the logits (for `loss_fn`) unless `gather_logits`."""
    if (llama := shard_llama_layer(layer, grid=grid, name=name, gather_logits=gather_logits)) is not None:
        return llama
    if isinstance(layer, Block):
        return shard_block(layer, grid=grid, name=name)
    tesseract = isinstance(grid, TesseractGrid)
    if isinstance(layer, Embedding):
        cls = layers_25d.EmbeddingGrid if tesseract else layers_1d.Embedding1D
        return cls(layer, grid=grid, name=name)
    if isinstance(layer, Head):
        head = layers_25d.HeadGrid if tesseract else layers_1d.Head1D
        return head(layer, grid=grid, name=name, gather=gather_logits)
    raise TypeError(f"no tensor-parallel version of {type(layer).__name__}")


def shard_model(
    model: nn.Sequential, *, grid: TensorGrid, first_index: int = 0, gather_logits: bool = False
) -> nn.Sequential:
    """Shard every layer (embedding, blocks and head all sharded). Names follow the dense indices,
    offset by `first_index` when `model` is a pipeline stage cut from a longer Sequential.

    The model's output is vocabulary-split logits (see `loss_fn` / cross_entropy.py); with
    `gather_logits=True` the head all-gathers them into whole rows instead, for a caller whose loss
    needs dense logits (each rank then holds its rows x the full vocabulary)."""
    names = [f"{first_index + n}" for n in range(len(model))]
    layers = [
        shard_layer(layer, grid=grid, name=n, gather_logits=gather_logits)
        for n, layer in zip(names, model, strict=True)
    ]
    return nn.Sequential(*layers)


def slicers(module: nn.Module) -> dict[str, Slicer]:
    """Every parameter's name -> the function that cuts this rank's shard from the dense tensor."""
    out: dict[str, Slicer] = {}
    for prefix, sub in module.named_modules():
        for pname, fn in getattr(sub, "slicers", {}).items():
            out[f"{prefix}.{pname}" if prefix else pname] = fn
    missing = {n for n, _ in module.named_parameters()} - set(out)
    assert not missing, f"parameters without a slicer: {sorted(missing)}"
    return out


def local_batch(t: torch.Tensor, *, grid: TensorGrid) -> torch.Tensor:
    """This rank's rows of a global batch: all of it for 1d, block k*q+i of d*q for the grid."""
    return t if isinstance(grid, Grid1D) else layers_25d.rows_of(t, grid)


def loss_fn(
    logits_BTv: torch.Tensor, targets_BT: torch.Tensor, *, grid: TensorGrid, global_rows: int
) -> torch.Tensor:
    """The part of the dense mean cross entropy this rank's rows contribute (1d: all of it), from
    the sharded model's vocabulary-split logits, by the vocab-parallel cross entropy (no rank
    gathers whole rows of logits).

    Ranks sharing rows (1d: all; grid: a row's q ranks) compute the same value; on the grid the sum
    of these terms over the d*q row blocks is the dense loss. The gradient of each rank's term with
    respect to its logits block is that block of the dense gradient."""
    assert targets_BT.shape[0] * row_blocks(grid) == global_rows, (
        f"{targets_BT.shape[0]} local rows x {row_blocks(grid)} row blocks != {global_rows} rows"
    )
    return tp_loss(logits_BTv, targets_BT, grid=grid)


def global_loss(local: torch.Tensor, *, grid: TensorGrid) -> float:
    """The dense loss value from every rank's local term (for reporting; not differentiated).
    A sync point: the value is read back to the host."""
    if isinstance(grid, Grid1D):
        return float(local.item())
    t = local.detach().clone().reshape(1)
    with comm.paused():
        comm.all_reduce(t, group=grid.col_peers, layer="loss", phase="fwd")
        comm.all_reduce(t, group=grid.depth_peers, layer="loss", phase="fwd")
    return float(t.item())


def grid_groups(grid: TensorGrid) -> tuple[dist.ProcessGroup, ...]:
    """Groups whose successive all-reduces sum a value over every rank of the tensor grid."""
    if isinstance(grid, Grid1D):
        return (grid.group,)
    return (grid.row_peers, grid.col_peers, grid.depth_peers)


def clip_grad_norm(
    params: Iterable[nn.Parameter],
    *,
    max_norm: float,
    grid: TensorGrid,
    also_over: Sequence[dist.ProcessGroup] = (),
) -> torch.Tensor:
    """torch.nn.utils.clip_grad_norm_ for a tensor-parallel model: `trainer.grads.clip_grad_norm_`
    (the one clipping implementation, shared with the composed engine) summed over the tensor grid,
    plus `also_over` (e.g. the pipeline group, when the model is also split into stages).
    Data-parallel replicas hold the same reduced gradients and must not be summed: do not pass
    their group. Returns the norm as a 0-d tensor on the gradients' device."""
    return clip_grad_norm_(params, max_norm=max_norm, groups=(*grid_groups(grid), *also_over))
