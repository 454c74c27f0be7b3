"""The partitioner's rule, its errors, and the pure-Python sizing the REST layer uses."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from jobrules import sizing
from jobrules.spec import ModelSpec, SpecError
from trainer.models import build_model
from trainer.spill.ledger import MiB
from trainer.spill.partition import (
    DoesNotFit,
    measure_layers,
    partition,
    plan_peak,
    state_bytes_per_param,
    working_set,
)

SHAPES = [
    {"kind": "gpt", "layers": 2, "d_model": 32, "heads": 4, "seq_len": 16, "mlp_ratio": 4},
    {"kind": "gpt", "layers": 3, "d_model": 48, "heads": 3, "seq_len": 8, "mlp_ratio": 2},
    {"kind": "mlp", "layers": 2, "d_model": 64, "heads": 1, "seq_len": 16, "mlp_ratio": 3},
]


@pytest.fixture(autouse=True)
def one_thread() -> None:
    torch.set_num_threads(1)


def costs_for(shape: dict, *, batch: int = 4, state_bpp: int = 8, dtype: torch.dtype = torch.float32):
    model = build_model(ModelSpec(**shape), seed=0)
    return measure_layers(
        model, batch_size=batch, seq_len=shape["seq_len"], state_bpp=state_bpp, param_dtype=dtype
    )


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s['kind']}-d{s['d_model']}")
def test_sizing_param_counts_are_exact(shape: dict) -> None:
    model = build_model(ModelSpec(**shape), seed=0)
    assert sizing.layer_param_counts(**shape) == [
        sum(p.numel() for p in layer.parameters()) for layer in model
    ]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s['kind']}-d{s['d_model']}")
@pytest.mark.parametrize(("optimizer", "momentum"), [("adamw", 0.0), ("sgd", 0.9), ("sgd", 0.0)])
def test_sizing_working_sets_equal_the_partitioners(shape: dict, optimizer: str, momentum: float) -> None:
    """fp32: the REST layer's numbers are the trainer's own (meta estimate), byte for byte."""
    bpp = state_bytes_per_param(optimizer=optimizer, momentum=momentum, offload=False)
    costs = costs_for(shape, state_bpp=bpp)
    mine = [working_set(costs, start=i, stop=i + 1) for i in range(len(costs))]
    rest = sizing.layer_working_sets(**shape, batch_size=4, optimizer=optimizer, momentum=momentum)
    assert rest == mine


def test_sizing_is_an_upper_bound_for_bf16_offload() -> None:
    shape = SHAPES[0]
    costs = costs_for(shape, state_bpp=0, dtype=torch.bfloat16)
    model = build_model(ModelSpec(**shape), seed=0)
    extra = sizing.offload_bucket_bytes(sum(p.numel() for p in model.parameters()))
    mine = [working_set(costs, start=i, stop=i + 1, extra_bytes=extra) for i in range(len(costs))]
    rest = sizing.layer_working_sets(**shape, batch_size=4, offload_dtype="bf16")
    assert all(r >= m for r, m in zip(rest, mine, strict=True))
    assert sum(c.param_bytes + c.grad_bytes for c in costs) / sum(c.numel for c in costs) == 4


def test_sizing_imports_no_torch() -> None:
    code = "import sys, jobrules.sizing, jobrules.space; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_meta_estimate_bounds_the_cpu_measurement() -> None:
    model = build_model(ModelSpec(**SHAPES[0]), seed=0)
    meta = measure_layers(model, batch_size=4, seq_len=16, state_bpp=8, device="meta")
    cpu = measure_layers(model, batch_size=4, seq_len=16, state_bpp=8, device="cpu")
    assert all(m.act_bytes >= c.act_bytes > 0 for m, c in zip(meta, cpu, strict=True))


def test_greedy_plans_fit_and_shrink_with_the_budget() -> None:
    costs = costs_for(dict(SHAPES[1], layers=6))
    finest = plan_peak(costs, cuts=list(range(1, len(costs))), prefetch=True)[0]
    whole = plan_peak(costs, cuts=[], prefetch=True)[0]
    shards = []
    for frac in (0.0, 0.25, 0.5, 1.0):
        budget = int(finest + frac * (whole - finest))
        plan = partition(costs, budget_bytes=budget, prefetch=True)
        assert plan.peak_bytes <= budget
        shards.append(plan.n_shards)
    assert shards == sorted(shards, reverse=True)
    assert shards[0] == len(costs) and shards[-1] == 1


def test_a_layer_larger_than_the_budget_is_refused_with_numbers() -> None:
    costs = costs_for(SHAPES[0])
    block = working_set(costs, start=1, stop=2)
    with pytest.raises(DoesNotFit) as e:
        partition(costs, budget_bytes=block - 1, prefetch=False)
    msg = str(e.value)
    assert "layer 1 (Block, 12,704 params)" in msg
    assert f"{(block - 1) / MiB:.3f}" in msg and f"{block / MiB:.3f} MiB" in msg
    assert isinstance(e.value, SpecError)


def test_prefetch_needs_room_for_the_neighbour() -> None:
    costs = costs_for(SHAPES[0])
    one_each = list(range(1, len(costs)))
    budget = plan_peak(costs, cuts=one_each, prefetch=False)[0]
    assert partition(costs, budget_bytes=budget, prefetch=False).peak_bytes <= budget
    with pytest.raises(DoesNotFit, match="turn prefetch off"):
        partition(costs, budget_bytes=budget, prefetch=True)


def test_reserved_workspaces_count_beside_every_shard_and_are_named_in_refusals() -> None:
    costs = costs_for(SHAPES[0])
    one_each = list(range(1, len(costs)))
    budget = plan_peak(costs, cuts=one_each, prefetch=False)[0]  # the finest plan, exactly
    reserved = 32 * MiB
    assert partition(costs, budget_bytes=budget, prefetch=False).cuts == one_each
    with pytest.raises(DoesNotFit, match=r"\+ library workspaces 32\.000 \(cuBLAS, measured\) MiB"):
        partition(costs, budget_bytes=budget, prefetch=False, reserved_bytes=reserved)
    plan = partition(costs, budget_bytes=budget + reserved, prefetch=False, reserved_bytes=reserved)
    assert plan.cuts == one_each and plan.peak_bytes == budget + reserved and plan.reserved_bytes == reserved
    with pytest.raises(DoesNotFit, match=r"of which 32\.000 MiB are library workspaces"):
        partition(costs, budget_bytes=budget + reserved, prefetch=False, cuts=[2], reserved_bytes=reserved)


@pytest.mark.parametrize("cuts", [[0], [3, 2], [1, 1], [4]])
def test_bad_hand_cuts_are_refused(cuts: list[int]) -> None:
    costs = costs_for(SHAPES[0])  # 4 layers
    with pytest.raises(SpecError, match=r"strictly increasing layer indices in \(0, 4\)"):
        partition(costs, budget_bytes=None, prefetch=True, cuts=cuts)


def test_hand_cuts_are_kept_and_checked_against_the_budget() -> None:
    costs = costs_for(SHAPES[0])
    plan = partition(costs, budget_bytes=None, prefetch=True, cuts=[1, 3])
    assert plan.bounds == [(0, 1), (1, 3), (3, 4)]
    with pytest.raises(DoesNotFit, match=r"cuts \[1, 3\] needs .* MiB at shard 1"):
        partition(costs, budget_bytes=plan.peak_bytes - 1, prefetch=True, cuts=[1, 3])


def test_counting_saved_activations_keeps_none_of_them_alive() -> None:
    """A graph made inside SavedActivations and dropped without a backward frees every tensor it
    saved (measure_layers' trial forward never runs backward; on a GPU the leak was the whole
    trial's activations, kept for the rest of the process)."""
    import gc
    import weakref

    from trainer.models import Block
    from trainer.spill.ledger import SavedActivations

    block = Block(d_model=32, heads=2, mlp_ratio=4)
    x = torch.randn(2, 8, 32, requires_grad=True)
    saved_refs: list[weakref.ref] = []

    class Watched(SavedActivations):
        def _pack(self, t: torch.Tensor) -> tuple[torch.Tensor, int]:
            saved_refs.append(weakref.ref(t))
            return super()._pack(t)

    with Watched() as saved:
        out = block(x)
    assert saved.nbytes > 0 and len(saved_refs) > 10
    del out
    gc.collect()
    leaves = {id(x), *(id(p) for p in block.parameters())}
    alive = [r() for r in saved_refs if r() is not None and id(r()) not in leaves]
    assert alive == [], [tuple(t.shape) for t in alive]


def test_a_saved_tensor_changed_in_place_fails_the_backward_under_saved_activations() -> None:
    """Saved-tensor hooks switch autograd's own version check off, so SavedActivations makes it:
    a backward through a tensor changed in place after it was saved fails, as it does without
    hooks, instead of silently giving wrong gradients (the spill engine's backward runs inside
    SavedActivations). An untouched saved tensor still gives autograd's gradient."""
    from trainer.spill.ledger import SavedActivations

    x = torch.randn(8, requires_grad=True)
    with SavedActivations():
        h = x * 1.0
        y = h.sin()  # saves h
        z = h.exp()  # saves its own output
    y.sum().backward(retain_graph=True)
    torch.testing.assert_close(x.grad, x.detach().cos())
    h.mul_(2)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()
    z.add_(1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        z.sum().backward()
