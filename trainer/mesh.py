"""The world mesh: every rank's place on the (pp, dp, tp) axes, checked before any process group
exists, then the process groups each parallelism uses.

Rank layout: rank = (pp_index * dp + dp_index) * tp + tp_index. The tensor axis is innermost so a
tensor group (the chattiest, several collectives per layer) is a run of adjacent ranks, i.e. one
node's GPUs under torchrun; data-parallel replicas talk once per step, pipeline neighbours once per
micro-batch. The tensor axis is itself 1d ("tp") or a d x q x q grid ("depth", "row", "col"), see
trainer/tensor/grid.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch.distributed as dist

from jobrules.spec import JobSpec, SpecError, TensorSpec


@dataclass(kw_only=True, frozen=True, slots=True)
class MeshShape:
    """Axis sizes; pure arithmetic, no process group."""

    pp: int = 1
    """Pipeline stages."""
    dp: int = 1
    """Data-parallel replicas."""
    tensor: TensorSpec | None = None
    """The tensor layout (None: no tensor parallelism)."""

    def __post_init__(self) -> None:
        if self.pp < 1 or self.dp < 1 or self.tp < 1:
            raise SpecError(f"mesh axes must be >= 1, got pp={self.pp} dp={self.dp} tp={self.tp}")

    @classmethod
    def from_job(cls, job: JobSpec) -> MeshShape:
        pp, dp, tp = job.parallel.axes
        return cls(pp=pp, dp=dp, tensor=job.parallel.tensor if tp > 1 else None)

    @property
    def tp(self) -> int:
        return self.tensor.world_size if self.tensor is not None else 1

    @property
    def world_size(self) -> int:
        return self.pp * self.dp * self.tp

    def check(self, world_size: int) -> None:
        """Before any process group: the launch must have exactly the ranks the layout needs."""
        if self.world_size != world_size:
            raise SpecError(
                f"the job needs pp*dp*tp = {self.pp}*{self.dp}*{self.tp} = {self.world_size} processes "
                f"but WORLD_SIZE is {world_size}; launch it with torchrun --nproc-per-node {self.world_size}"
            )

    def coords(self, rank: int) -> tuple[int, int, int]:
        """(pp_index, dp_index, tp_index) of a global rank."""
        return rank // (self.dp * self.tp), (rank // self.tp) % self.dp, rank % self.tp

    def rank_of(self, *, pp: int, dp: int, tp: int) -> int:
        return (pp * self.dp + dp) * self.tp + tp

    def pipeline_ranks(self, *, dp: int, tp: int) -> list[int]:
        """Global ranks of the stages of one pipeline, stage order."""
        return [self.rank_of(pp=s, dp=dp, tp=tp) for s in range(self.pp)]

    def replica_ranks(self, *, dp: int) -> list[int]:
        """Every rank of one data-parallel replica (its pipeline stages x tensor ranks): the group
        over which one copy of the model is spread, so the one a gradient norm is summed over."""
        return [self.rank_of(pp=s, dp=dp, tp=t) for s in range(self.pp) for t in range(self.tp)]

    def tp_dims(self) -> tuple[tuple[int, ...], tuple[str, ...]]:
        t = self.tensor
        if t is None or t.mode == "1d":
            return (self.tp,), ("tp",)
        return (t.d if t.mode == "2.5d" else 1, t.q, t.q), ("depth", "row", "col")


@dataclass(kw_only=True, slots=True)
class WorldMesh:
    """This rank's coordinates and groups. Groups are None where the axis has size 1 (or there is
    no process group at all: a single-process job builds none)."""

    shape: MeshShape
    rank: int = 0
    pp_index: int = 0
    dp_index: int = 0
    tp_index: int = 0
    dp_group: dist.ProcessGroup | None = None
    replica_group: dist.ProcessGroup | None = None
    """pp x tp ranks of this replica: gradient-norm sums, loss reporting inside a replica."""
    tp_grid: object | None = None
    """trainer.tensor.grid.TensorGrid of this rank's tensor group (None without tensor axis)."""
    pipeline_ranks: list[int] = field(default_factory=lambda: [0])

    @property
    def lead(self) -> bool:
        return self.rank == 0


def single_process_mesh() -> WorldMesh:
    return WorldMesh(shape=MeshShape())


def build_world_mesh(shape: MeshShape, *, device_type: str) -> WorldMesh:
    """The groups of an initialised world (call shape.check(world) first). Every rank creates every
    group in the same order, as torch requires."""
    from torch.distributed.device_mesh import init_device_mesh

    world, rank = dist.get_world_size(), dist.get_rank()
    shape.check(world)
    pp_i, dp_i, tp_i = shape.coords(rank)
    tp_sizes, tp_names = shape.tp_dims()
    dm = init_device_mesh(
        device_type, (shape.pp, shape.dp, *tp_sizes), mesh_dim_names=("pp", "dp", *tp_names)
    )
    tp_grid = None
    if shape.tp > 1:
        from trainer.tensor.grid import tensor_grid

        tp_grid = tensor_grid(dm[tp_names])
    replica_group = None
    if shape.pp * shape.tp > 1:
        replica_group, _ = dist.new_subgroups_by_enumeration(
            [shape.replica_ranks(dp=d) for d in range(shape.dp)]
        )
    return WorldMesh(
        shape=shape,
        rank=rank,
        pp_index=pp_i,
        dp_index=dp_i,
        tp_index=tp_i,
        dp_group=dm.get_group("dp") if shape.dp > 1 else None,
        replica_group=replica_group,
        tp_grid=tp_grid,
        pipeline_ranks=shape.pipeline_ranks(dp=dp_i, tp=tp_i),
    )
