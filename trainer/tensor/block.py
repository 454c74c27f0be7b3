"""Dense GPT layers -> their tensor-parallel versions for a mesh, plus the pieces a training step
needs around them: this rank's share of a batch, the loss, and the shard of any dense tensor.

A sharded model keeps the dense model's parameter names (`1.attn.qkv.weight`, ...), so a test or a
checkpoint can match every shard to the dense parameter it was cut from.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from trainer.llama_tp import shard_llama_layer
from trainer.models import Block, Embedding, Head
from trainer.tensor import comm, layers_1d, layers_25d
from trainer.tensor.layers_1d import Slicer
from trainer.tensor.mesh import Mesh1D, MeshGrid, TensorMesh


class BlockTP(nn.Module):
    """Pre-norm block with the dense Block's forward; only the layers inside are sharded."""

    def __init__(self, *, ln1: nn.Module, attn: nn.Module, ln2: nn.Module, mlp: nn.Module) -> None:
        super().__init__()
        self.ln1, self.attn, self.ln2, self.mlp = ln1, attn, ln2, mlp

    def forward(self, x_BTD: torch.Tensor) -> torch.Tensor:
        x_BTD = x_BTD + self.attn(self.ln1(x_BTD))
        return x_BTD + self.mlp(self.ln2(x_BTD))


def shard_block(block: Block, *, mesh: TensorMesh, name: str) -> BlockTP:
    if isinstance(mesh, Mesh1D):
        m = layers_1d
        return BlockTP(
            ln1=m.LayerNorm1D(block.ln1, mesh=mesh, name=f"{name}.ln1"),
            attn=m.Attention1D(block.attn, mesh=mesh, name=f"{name}.attn"),
            ln2=m.LayerNorm1D(block.ln2, mesh=mesh, name=f"{name}.ln2"),
            mlp=m.MLP1D(block.mlp, mesh=mesh, name=f"{name}.mlp"),
        )
    g = layers_25d
    return BlockTP(
        ln1=g.LayerNormGrid(block.ln1, mesh=mesh, name=f"{name}.ln1"),
        attn=g.AttentionGrid(block.attn, mesh=mesh, name=f"{name}.attn"),
        ln2=g.LayerNormGrid(block.ln2, mesh=mesh, name=f"{name}.ln2"),
        mlp=g.MLPGrid(block.mlp, mesh=mesh, name=f"{name}.mlp"),
    )


def shard_layer(layer: nn.Module, *, mesh: TensorMesh, name: str) -> nn.Module:
    """One layer of the GPT's nn.Sequential: embedding, block or head (or a Llama layer, 1d)."""
    if (llama := shard_llama_layer(layer, mesh=mesh, name=name)) is not None:
        return llama
    if isinstance(layer, Block):
        return shard_block(layer, mesh=mesh, name=name)
    grid = isinstance(mesh, MeshGrid)
    if isinstance(layer, Embedding):
        cls = layers_25d.EmbeddingGrid if grid else layers_1d.Embedding1D
        return cls(layer, mesh=mesh, name=name)
    if isinstance(layer, Head):
        cls = layers_25d.HeadGrid if grid else layers_1d.Head1D
        return cls(layer, mesh=mesh, name=name)
    raise TypeError(f"no tensor-parallel version of {type(layer).__name__}")


def shard_model(model: nn.Sequential, *, mesh: TensorMesh, first_index: int = 0) -> nn.Sequential:
    """Shard every layer (embedding, blocks and head all sharded). Names follow the dense indices,
    offset by `first_index` when `model` is a pipeline stage cut from a longer Sequential."""
    names = [f"{first_index + n}" for n in range(len(model))]
    layers = [shard_layer(layer, mesh=mesh, name=n) for n, layer in zip(names, model, strict=True)]
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


def local_batch(t: torch.Tensor, *, mesh: TensorMesh) -> torch.Tensor:
    """This rank's rows of a global batch: all of it for 1d, block k*q+i of d*q for the grid."""
    return t if isinstance(mesh, Mesh1D) else layers_25d.rows_of(t, mesh)


def loss_fn(
    logits_BTV: torch.Tensor, targets_BT: torch.Tensor, *, mesh: TensorMesh, global_rows: int
) -> torch.Tensor:
    """The part of the dense mean cross entropy this rank's rows contribute (1d: all of it).

    On the grid each rank holds full-vocabulary logits for its B/(dq) rows, identical across its row
    peers, so the sum over row blocks of these local terms is the dense loss and its gradient with
    respect to each rank's logits is the dense one."""
    ce = F.cross_entropy(logits_BTV.flatten(0, 1).float(), targets_BT.flatten(), reduction="sum")
    return ce / (global_rows * targets_BT.shape[1])


def global_loss(local: torch.Tensor, *, mesh: TensorMesh) -> float:
    """The dense loss value from every rank's local term (for reporting; not differentiated)."""
    if isinstance(mesh, Mesh1D):
        return float(local.item())
    t = local.detach().clone().reshape(1)
    with comm.paused():
        comm.all_reduce(t, group=mesh.col_peers, layer="loss", phase="fwd")
        comm.all_reduce(t, group=mesh.depth_peers, layer="loss", phase="fwd")
    return float(t.item())


def clip_grad_norm(params: list[nn.Parameter], *, max_norm: float, group: dist.ProcessGroup) -> float:
    """Global gradient norm over the shards of `group` (every rank holding part of the model),
    counting each replicated parameter once."""
    sq = torch.zeros(1, dtype=torch.float64)
    for p in params:
        if p.grad is not None:
            sq += p.grad.double().pow(2).sum() / getattr(p, "tp_replicas", 1)
    with comm.paused():
        comm.all_reduce(sq, group=group, layer="clip", phase="bwd")
    norm = float(sq.sqrt().item())
    scale = max_norm / (norm + 1e-6)
    if scale < 1.0:
        for p in params:
            if p.grad is not None:
                p.grad.mul_(scale)
    return norm
