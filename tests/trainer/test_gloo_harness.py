import pytest
import torch
import torch.distributed as dist

from tests.gloo import run_ranks


def _sum_ranks(rank: int, world_size: int) -> float:
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    return t.item()


def _fail_on_one(rank: int, world_size: int) -> None:
    if rank == 1:
        raise ValueError("boom on rank 1")


def test_all_reduce_over_real_gloo_ranks() -> None:
    assert run_ranks(_sum_ranks, world_size=3) == [3.0, 3.0, 3.0]


def test_a_failing_rank_is_reported() -> None:
    with pytest.raises(RuntimeError, match="boom on rank 1"):
        run_ranks(_fail_on_one, world_size=2, timeout_s=60)
