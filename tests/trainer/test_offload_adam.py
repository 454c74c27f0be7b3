"""The AxoNN offloaded optimizer against torch.optim.AdamW: exact in fp32 mode, to mixed-precision
tolerance in bf16 mode; fp16 loss scaling skips a real step on an inf gradient and lowers the
scale; only the bucket buffers are computed on. Device = CPU (the same code path as CUDA, without
the side stream)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from jobrules.spec import OffloadSpec
from tests.device_census import DeviceCensus
from tests.trainer.test_spill_engine import ADAMW, MODEL, make_engine, make_stream
from trainer.spill.engine import SpillEngine
from trainer.spill.ledger import DeviceLedger
from trainer.spill.offload import NonFiniteGradient, OffloadedAdamW, bucket_bytes

CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def one_thread() -> None:
    torch.set_num_threads(1)


def make_groups(sizes: list[int], seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, generator=g) for n in sizes]


def grads_for(step: int, sizes: list[int]) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    return [torch.randn(n, generator=g) * 0.1 for n in sizes]


def run_both(
    *, dtype: torch.dtype, steps: int = 10, sizes: list[int] | None = None, bucket: int = 37
) -> tuple[list[torch.Tensor], list[torch.Tensor], OffloadedAdamW, list[torch.Tensor]]:
    """Same gradients (fp32 for torch, cast to `dtype` for the offloaded one) for `steps` steps."""
    sizes = sizes or [100, 257, 3]
    ref = [t.clone().requires_grad_(True) for t in make_groups(sizes)]
    opt = torch.optim.AdamW(ref, lr=1e-2, weight_decay=0.1)
    masters = [t.clone() for t in make_groups(sizes)]
    off = OffloadedAdamW(
        masters=masters,
        lr=1e-2,
        weight_decay=0.1,
        dtype=dtype,
        device=CPU,
        bucket_numel=bucket,
        ledger=DeviceLedger(),
    )
    dev_params = [m.to(dtype) for m in masters]
    for step in range(steps):
        grads = grads_for(step, sizes)
        for p, g in zip(ref, grads, strict=True):
            p.grad = g.clone()
        opt.step()
        for i, g in enumerate(grads):
            dev_grads = g.to(dtype)
            assert not off.found_inf(dev_grads)
            off.step_group(i, params=dev_params[i], grads=dev_grads)
    return [p.detach() for p in ref], masters, off, dev_params


def test_fp32_mode_matches_torch_adamw_exactly() -> None:
    ref, masters, off, dev_params = run_both(dtype=torch.float32)
    for r, m, d in zip(ref, masters, dev_params, strict=True):
        torch.testing.assert_close(m, r, rtol=0, atol=0)
        torch.testing.assert_close(d, r, rtol=0, atol=0)
    assert off.steps == [10, 10, 10]


def test_fp32_mode_matches_with_one_bucket_and_many() -> None:
    """Bucket boundaries split parameters anywhere; the result must not depend on them."""
    a = run_both(dtype=torch.float32, bucket=1)[1]
    b = run_both(dtype=torch.float32, bucket=10_000)[1]
    for x, y in zip(a, b, strict=True):
        torch.testing.assert_close(x, y, rtol=0, atol=0)


def test_bf16_mode_matches_to_mixed_precision_tolerance() -> None:
    ref, masters, off, dev_params = run_both(dtype=torch.bfloat16)
    for i, (r, m, d) in enumerate(zip(ref, masters, dev_params, strict=True)):
        # bf16 gradients carry ~3 significant digits; Adam's normalised steps of lr=1e-2 over
        # 10 steps move weights by <= 0.1, so an error of a few percent of that is the budget
        torch.testing.assert_close(m, r, rtol=0, atol=5e-3)
        # the device copy is the master rounded to bf16, nothing else
        torch.testing.assert_close(d, m.to(torch.bfloat16), rtol=0, atol=0)
        torch.testing.assert_close(off.host_lp[i], d, rtol=0, atol=0)
    # and the error is really there (bf16 was used), not zero
    assert max((m - r).abs().max().item() for r, m in zip(ref, masters, strict=True)) > 0


def _offloaded_engine(dtype: str, cuts: list[int]) -> SpillEngine:
    engine, _, _ = make_engine(MODEL, ADAMW, cuts=cuts, offload=OffloadSpec(optimizer=True, dtype=dtype))
    return engine


def _snapshot(engine: SpillEngine) -> dict[str, Any]:
    """Everything a step would change in host memory: fp32 masters, Adam moments and step counts,
    the low-precision copies the device is loaded from."""
    opt = engine.opt
    assert opt is not None
    return {
        "masters": engine.model_state(),
        "moments": [t.clone() for t in (*opt.exp_avg, *opt.exp_avg_sq)],
        "steps": list(opt.steps),
        "host_lp": [t.clone() for t in opt.host_lp],
    }


def _assert_device_copies_hold(engine: SpillEngine, host_lp: list[torch.Tensor]) -> None:
    """Every shard resident on the device computes with the low-precision values `host_lp`."""
    resident = [s for s in engine.shards if s.dev is not None]
    assert resident
    for s in resident:
        torch.testing.assert_close(s.dev, host_lp[s.index], rtol=0, atol=0)


def _inf_in_one_gradient(engine: SpillEngine) -> torch.utils.hooks.RemovableHandle:
    """A hook on one weight of the first layer: its gradient gets an inf in one row during the real
    backward (the first layer's backward runs last, so every other gradient is finite)."""
    weight = engine.shards[0].params[0]

    def poison(g: torch.Tensor) -> torch.Tensor:
        return g.index_fill(0, torch.tensor([3]), float("inf"))

    return weight.register_hook(poison)


@pytest.mark.parametrize("cuts", [[], [2]], ids=["one-shard", "two-shards-deferred"])
def test_inf_gradient_skips_the_step_and_lowers_the_loss_scale(cuts: list[int]) -> None:
    """fp16, dynamic loss scaling: a real training step whose backward yields an inf gradient. The
    step is attempted; nothing it would change changes (masters, moments, step counts, host and
    device low-precision copies) and the scale halves. The next clean step does update. Both the
    per-shard step (one shard) and the deferred step (two shards: one global decision)."""
    stream = make_stream()
    engine = _offloaded_engine("fp16", cuts)
    opt = engine.opt
    assert opt is not None
    engine.train_step(*stream.batch_for(0))  # moments non-zero, so "unchanged" means something
    assert opt.scaler.skipped_steps == 0
    scale, before = opt.scaler.scale, _snapshot(engine)

    handle = _inf_in_one_gradient(engine)
    engine.train_step(*stream.batch_for(1))
    handle.remove()

    assert opt.scaler.skipped_steps == 1
    assert opt.scaler.scale == scale / 2
    torch.testing.assert_close(_snapshot(engine), before, rtol=0, atol=0)
    _assert_device_copies_hold(engine, before["host_lp"])

    engine.train_step(*stream.batch_for(1))
    assert opt.scaler.skipped_steps == 1
    after = _snapshot(engine)
    assert after["steps"] == [n + 1 for n in before["steps"]]
    for name, value in after["masters"].items():
        assert not torch.equal(value, before["masters"][name]), name


def test_inf_gradient_without_loss_scaling_fails_the_step_and_changes_nothing() -> None:
    """bf16 has no dynamic scale to lower: an inf gradient in a real step is a terminal error, raised
    before any parameter or optimizer state moves."""
    stream = make_stream()
    engine = _offloaded_engine("bf16", [])
    engine.train_step(*stream.batch_for(0))
    before = _snapshot(engine)
    _inf_in_one_gradient(engine)
    with pytest.raises(NonFiniteGradient):
        engine.train_step(*stream.batch_for(1))
    torch.testing.assert_close(_snapshot(engine), before, rtol=0, atol=0)
    _assert_device_copies_hold(engine, before["host_lp"])


def test_engine_fp16_overflow_skips_step_and_backs_off() -> None:
    """Through the engine: a loss scale so large the fp16 gradients overflow -> the step is
    skipped (weights unchanged) and the scale drops; training then proceeds."""
    stream = make_stream()
    engine, _, _ = make_engine(MODEL, ADAMW, cuts=[], offload=OffloadSpec(optimizer=True, dtype="fp16"))
    assert engine.opt is not None
    engine.opt.scaler.scale = 2.0**40
    before = engine.model_state()
    engine.train_step(*stream.batch_for(0))
    assert engine.opt.scaler.skipped_steps == 1
    assert engine.opt.scaler.scale == 2.0**39
    torch.testing.assert_close(engine.model_state(), before, rtol=0, atol=0)
    while engine.opt.scaler.scale > 2.0**16:
        engine.train_step(*stream.batch_for(0))
    skipped = engine.opt.scaler.skipped_steps
    losses = [engine.train_step(*stream.batch_for(s)) for s in range(1, 11)]
    assert engine.opt.scaler.skipped_steps == skipped
    assert losses[-1] < losses[0]


def test_bucket_buffers_are_the_only_fp32_on_the_device() -> None:
    """A real step of two groups over many buckets, under a census of the storages its kernels
    compute on (tests/device_census.py): only the bucket buffers, all held for the run (no
    temporaries), their bytes equal to what the ledger and `device_bytes` say; the fp32 masters and
    moments in host memory are only ever copy endpoints. The update did happen."""
    sizes, bucket = [1000, 300], 64
    masters = make_groups(sizes)
    before = [m.clone() for m in masters]
    ledger = DeviceLedger()
    off = OffloadedAdamW(
        masters=masters, lr=1e-3, dtype=torch.bfloat16, device=CPU, bucket_numel=bucket, ledger=ledger
    )
    params = [m.to(torch.bfloat16) for m in masters]
    grads = [g.to(torch.bfloat16) for g in grads_for(0, sizes)]
    with DeviceCensus(CPU) as census:
        for i in range(len(sizes)):
            off.step_group(i, params=params[i], grads=grads[i])
    seen = list(census.seen.values())
    assert all(s.alive for s in seen), "a temporary was computed on during the step"
    assert {s.dtype for s in seen} == {torch.float32}
    assert sum(s.nbytes for s in seen) == bucket_bytes(bucket) == 64 * 40
    assert ledger.entries == {"offload.buckets": bucket_bytes(bucket)} and off.device_bytes == bucket_bytes(
        bucket
    )
    host = [*masters, *off.exp_avg, *off.exp_avg_sq, *off.host_lp]
    assert not any(census.holds(t) for t in host)
    assert all(not torch.equal(m, b) for m, b in zip(masters, before, strict=True))


def test_fp16_spilled_equals_fp16_resident_including_skips() -> None:
    """fp16 with several shards takes the deferred path (one global inf check before any step):
    it matches the one-shard run exactly, skipped steps and loss-scale changes included."""
    stream = make_stream()
    fp16 = OffloadSpec(optimizer=True, dtype="fp16")
    runs = []
    for cuts in ([], [2], [1, 2, 3, 4]):
        engine, _, _ = make_engine(MODEL, ADAMW, cuts=cuts, offload=fp16)
        assert engine.opt is not None and engine.deferred == bool(cuts)
        engine.opt.scaler.scale = 2.0**22  # overflows at first: the first steps are skipped
        # one batch throughout: once the skips end, its loss must fall (batches differ in difficulty)
        losses = [engine.train_step(*stream.batch_for(0)) for _ in range(12)]
        runs.append((losses, engine.opt.scaler.skipped_steps, engine.opt.scaler.scale, engine.model_state()))
    for losses, skipped, scale, state in runs[1:]:
        assert losses == runs[0][0] and skipped == runs[0][1] and scale == runs[0][2]
        torch.testing.assert_close(state, runs[0][3], rtol=0, atol=0)
    assert runs[0][1] >= 1 and runs[0][2] < 2.0**22
    assert runs[0][0][-1] < runs[0][0][0]
