"""Tensor-parallel process grids: the shape checks (run before any process group exists) and the groups.

Rank layout. 1d: one axis "tp" of `size` ranks. 2d and 2.5d: a (depth, row, col) grid of d x q x q
ranks in row-major order, rank = k*q*q + i*q + j (2d is d = 1). SUMMA talks about "broadcast along a
row": that is the group of ranks that share (k, i) and differ in j, i.e. the DeviceMesh axis "col".
To keep that straight the groups here are named by who is in them, not by the axis they vary:

    row_peers   (k, i, *)   same depth layer and row     -> activation blocks travel here
    col_peers   (k, *, j)   same depth layer and column  -> weight blocks travel here
    depth_peers (*, i, j)   same place in every layer    -> weight gradients are all-reduced here
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from jobrules.models import tensor_kind_problems
from jobrules.spec import ModelSpec, SpecError, TensorSpec

VOCAB = 128


def check_tensor_layout(tensor: TensorSpec, *, world_size: int, model: ModelSpec, batch_size: int) -> None:
    """Every divisibility rule the sharded layers rely on; raises SpecError with the numbers.

    Call it before creating any process group: a bad shape should fail in milliseconds with a reason,
    not as a hang or a shape error inside a collective.
    """
    need = tensor.world_size
    if need != world_size:
        raise SpecError(
            f"parallel.tensor {tensor.mode} needs {need} ranks "
            f"({_ranks_formula(tensor)}) but the tensor axis has {world_size}"
        )
    split = tensor.size if tensor.mode == "1d" else tensor.q
    if problems := tensor_kind_problems(model.model_dump(), mode=tensor.mode, split=split):
        raise SpecError("; ".join(problems))
    what = "parallel.tensor.size" if tensor.mode == "1d" else "parallel.tensor.q"
    ffn = model.mlp_ratio * model.d_model
    for name, value in (
        ("model.heads", model.heads),
        ("model.d_model", model.d_model),
        ("the MLP width (mlp_ratio * d_model)", ffn),
        (f"the vocabulary ({model.vocab_size or VOCAB})", model.vocab_size or VOCAB),
    ):
        if value % split:
            raise SpecError(f"{name} ({value}) must be divisible by {what} ({split}) for {tensor.mode}")
    if tensor.mode != "1d":
        rows = tensor.d * tensor.q
        if batch_size % rows:
            raise SpecError(
                f"train.batch_size ({batch_size}) must be divisible by d*q ({tensor.d}*{tensor.q} = {rows}) "
                f"for {tensor.mode}: the batch is split over depth and rows"
            )


def _ranks_formula(tensor: TensorSpec) -> str:
    if tensor.mode == "1d":
        return f"size = {tensor.size}"
    if tensor.mode == "2d":
        return f"q*q = {tensor.q}*{tensor.q}"
    return f"q*q*d = {tensor.q}*{tensor.q}*{tensor.d}"


@dataclass(kw_only=True, slots=True)
class Grid1D:
    """Megatron's one tensor axis: a line of `size` ranks."""

    group: dist.ProcessGroup
    size: int
    rank: int
    """This rank's index on the axis (not the global rank)."""

    @property
    def mode(self) -> str:
        return "1d"


@dataclass(kw_only=True, slots=True)
class TesseractGrid:
    """A d x q x q Tesseract grid of ranks (d = 1 is 2-D SUMMA)."""

    q: int
    d: int
    k: int
    """This rank's depth layer."""
    i: int
    """This rank's row."""
    j: int
    """This rank's column."""
    row_peers: dist.ProcessGroup
    col_peers: dist.ProcessGroup
    depth_peers: dist.ProcessGroup
    row_ranks: list[int]
    """Global ranks of row_peers, indexed by column j (broadcast roots are global ranks)."""
    col_ranks: list[int]
    """Global ranks of col_peers, indexed by row i."""

    @property
    def mode(self) -> str:
        return "2d" if self.d == 1 else "2.5d"

    @property
    def row_block(self) -> int:
        """Index of this rank's block of batch rows: inputs are split over depth, then rows."""
        return self.k * self.q + self.i


TensorGrid = Grid1D | TesseractGrid


def device_mesh_for(tensor: TensorSpec, *, device_type: str = "cpu") -> DeviceMesh:
    """The DeviceMesh over the whole world for a tensor-only job (composed jobs slice theirs)."""
    if tensor.mode == "1d":
        return init_device_mesh(device_type, (tensor.size,), mesh_dim_names=("tp",))
    return init_device_mesh(
        device_type, (tensor.d, tensor.q, tensor.q), mesh_dim_names=("depth", "row", "col")
    )


def tensor_grid(dm: DeviceMesh) -> TensorGrid:
    """Groups and coordinates from a DeviceMesh with axes ("tp",) or ("depth", "row", "col")."""
    names = dm.mesh_dim_names
    if names == ("tp",):
        return Grid1D(group=dm.get_group("tp"), size=dm.size(), rank=dm.get_local_rank("tp"))
    if names != ("depth", "row", "col"):
        raise ValueError(f"a tensor grid has axes ('tp',) or ('depth', 'row', 'col'), got {names}")
    d, q, q2 = dm.mesh.shape
    assert q == q2, f"grid must be square, got {q} x {q2}"
    row_peers = dm.get_group("col")
    col_peers = dm.get_group("row")
    return TesseractGrid(
        q=q,
        d=d,
        k=dm.get_local_rank("depth"),
        i=dm.get_local_rank("row"),
        j=dm.get_local_rank("col"),
        row_peers=row_peers,
        col_peers=col_peers,
        depth_peers=dm.get_group("depth"),
        row_ranks=dist.get_process_group_ranks(row_peers),
        col_ranks=dist.get_process_group_ranks(col_peers),
    )


def tensor_grid_for(tensor: TensorSpec, *, device_type: str = "cpu") -> TensorGrid:
    return tensor_grid(device_mesh_for(tensor, device_type=device_type))
