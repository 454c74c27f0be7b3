"""Shape and world-size checks of tensor-parallel layouts: they run before any process group exists
and name the numbers that broke the rule."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from jobrules.spec import ModelSpec, SpecError, TensorSpec
from trainer.tensor.grid import check_tensor_layout

MODEL = ModelSpec(d_model=64, heads=4, seq_len=16, layers=2)


def _check(tensor: TensorSpec, *, world: int, model: ModelSpec = MODEL, batch: int = 8) -> None:
    check_tensor_layout(tensor, world_size=world, model=model, batch_size=batch)


@pytest.mark.parametrize(
    ("tensor", "world"),
    [
        (TensorSpec(mode="1d", size=4), 4),
        (TensorSpec(mode="2d", q=2), 4),
        (TensorSpec(mode="2.5d", q=2, d=2), 8),
        (TensorSpec(mode="2.5d", q=4, d=1), 16),
    ],
)
def test_good_layouts_pass(tensor: TensorSpec, world: int) -> None:
    _check(tensor, world=world)
    assert not dist.is_initialized()


@pytest.mark.parametrize(
    ("tensor", "world", "model", "batch", "message"),
    [
        (TensorSpec(mode="2.5d", q=2, d=2), 4, MODEL, 8, r"needs 8 ranks \(q\*q\*d = 2\*2\*2\).*has 4"),
        (TensorSpec(mode="2d", q=2), 8, MODEL, 8, r"needs 4 ranks \(q\*q = 2\*2\).*has 8"),
        (TensorSpec(mode="1d", size=8), 8, MODEL, 8, r"model.heads \(4\).*parallel.tensor.size \(8\)"),
        (
            TensorSpec(mode="2d", q=3),
            9,
            ModelSpec(d_model=48, heads=3, seq_len=16),
            9,
            r"vocabulary \(128\).*parallel.tensor.q \(3\)",
        ),
        (
            TensorSpec(mode="2d", q=4),
            16,
            ModelSpec(d_model=48, heads=6, seq_len=16),
            8,
            r"model.heads \(6\).*parallel.tensor.q \(4\) for 2d",
        ),
        (TensorSpec(mode="2.5d", q=2, d=2), 8, MODEL, 6, r"batch_size \(6\).*d\*q \(2\*2 = 4\)"),
        (TensorSpec(mode="1d", size=2), 2, ModelSpec(kind="mlp"), 8, r"model.kind is 'mlp'"),
    ],
)
def test_bad_layouts_are_refused_with_the_numbers(
    tensor: TensorSpec, world: int, model: ModelSpec, batch: int, message: str
) -> None:
    with pytest.raises(SpecError, match=message):
        _check(tensor, world=world, model=model, batch=batch)
    assert not dist.is_initialized()


def test_a_tensor_job_is_refused_before_joining_a_group(monkeypatch: pytest.MonkeyPatch) -> None:
    from jobrules.spec import JobSpec, ParallelSpec, TrainSpec
    from trainer.protocol import ListSink, NeverStop
    from trainer.runner import run

    monkeypatch.setenv("WORLD_SIZE", "8")
    # a layout the grid cannot split is refused by the spec's own rules (jobrules), before any run
    # (built directly, the model raises pydantic's error; load_job raises SpecError)
    with pytest.raises(ValueError, match=r"train.batch_size \(6\) must be divisible by d\*q \(4\)"):
        JobSpec(
            model=MODEL,
            train=TrainSpec(batch_size=6),
            parallel=ParallelSpec(tensor=TensorSpec(mode="2.5d", q=2, d=2)),
        )
    # a valid layout launched on the wrong number of processes is refused before joining a group
    job = JobSpec(
        model=MODEL,
        train=TrainSpec(batch_size=8),
        parallel=ParallelSpec(tensor=TensorSpec(mode="2.5d", q=2, d=2), data_parallel=2),
    )
    with pytest.raises(SpecError, match=r"WORLD_SIZE is 8"):
        run(job, sink=ListSink(), stop=NeverStop())
    assert not dist.is_initialized()
