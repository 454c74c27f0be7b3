"""The AxoNN offloaded optimizer against torch.optim.AdamW: exact in fp32 mode, to mixed-precision
tolerance in bf16 mode; fp16 loss scaling skips a step on inf and lowers the scale. Device = CPU
(the same code path as CUDA, without the side stream)."""

from __future__ import annotations

import pytest
import torch

from tests.trainer.test_spill_engine import ADAMW, MODEL, make_engine, make_stream
from trainer.config import OffloadConfig
from trainer.spill.ledger import DeviceLedger
from trainer.spill.offload import LossScaler, OffloadedAdamW, bucket_bytes

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


def test_inf_gradient_skips_the_step_and_lowers_the_loss_scale() -> None:
    sizes = [50]
    masters = make_groups(sizes)
    before = masters[0].clone()
    scaler = LossScaler(scale=2.0**16, dynamic=True, growth_interval=3)
    off = OffloadedAdamW(
        masters=masters,
        lr=1e-2,
        dtype=torch.float16,
        device=CPU,
        bucket_numel=16,
        ledger=DeviceLedger(),
        scaler=scaler,
    )
    params = masters[0].to(torch.float16)
    grads = (grads_for(0, sizes)[0] * scaler.scale).to(torch.float16)
    grads[7] = float("inf")
    assert off.found_inf(grads)
    scaler.update(found_inf=True)
    assert scaler.scale == 2.0**15 and scaler.skipped_steps == 1
    torch.testing.assert_close(masters[0], before, rtol=0, atol=0)
    assert off.steps == [0]
    # clean steps: the update happens, unscaled by the current scale; the scale grows back
    for step in range(3):
        g = (grads_for(step, sizes)[0] * scaler.scale).to(torch.float16)
        assert not off.found_inf(g)
        off.step_group(0, params=params, grads=g)
        scaler.update(found_inf=False)
    assert off.steps == [3]
    assert scaler.scale == 2.0**16
    assert not torch.equal(masters[0], before)


def test_engine_fp16_overflow_skips_step_and_backs_off() -> None:
    """Through the engine: a loss scale so large the fp16 gradients overflow -> the step is
    skipped (weights unchanged) and the scale drops; training then proceeds."""
    stream = make_stream()
    engine, _, _ = make_engine(MODEL, ADAMW, cuts=[], offload=OffloadConfig(optimizer=True, dtype="fp16"))
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
    ledger = DeviceLedger()
    OffloadedAdamW(
        masters=make_groups([1000]), lr=1e-3, dtype=torch.bfloat16, device=CPU, bucket_numel=64, ledger=ledger
    )
    assert ledger.entries == {"offload.buckets": bucket_bytes(64)} and bucket_bytes(64) == 64 * 40


def test_fp16_spilled_equals_fp16_resident_including_skips() -> None:
    """fp16 with several shards takes the deferred path (one global inf check before any step):
    it matches the one-shard run exactly, skipped steps and loss-scale changes included."""
    stream = make_stream()
    fp16 = OffloadConfig(optimizer=True, dtype="fp16")
    runs = []
    for cuts in ([], [2], [1, 2, 3, 4]):
        engine, _, _ = make_engine(MODEL, ADAMW, cuts=cuts, offload=fp16)
        assert engine.opt is not None and engine.deferred == bool(cuts)
        engine.opt.scaler.scale = 2.0**36  # overflows at first: the first steps are skipped
        losses = [engine.train_step(*stream.batch_for(s)) for s in range(12)]
        runs.append((losses, engine.opt.scaler.skipped_steps, engine.opt.scaler.scale, engine.model_state()))
    for losses, skipped, scale, state in runs[1:]:
        assert losses == runs[0][0] and skipped == runs[0][1] and scale == runs[0][2]
        torch.testing.assert_close(state, runs[0][3], rtol=0, atol=0)
    assert runs[0][1] >= 1 and runs[0][2] < 2.0**36
    assert runs[0][0][-1] < runs[0][0][0]
