"""Spilled training equals resident training (trainer/loop.py semantics: same seed, same batches
from BatchStream.batch_for), and the device ledger stays under the budget. Device = CPU here: the
engine still keeps separate host and "device" copies, through the same code path as CUDA."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from jobrules.spec import DataSpec, ModelSpec, OffloadSpec, TrainSpec
from tests.device_census import DeviceCensus, Seen
from trainer.data import BatchStream, TextData
from trainer.models import build_model, count_params, lm_loss
from trainer.optim import build_optimizer
from trainer.spill.engine import SpillEngine
from trainer.spill.ledger import BudgetExceeded, DeviceLedger
from trainer.spill.offload import DTYPES, bucket_bytes
from trainer.spill.partition import DoesNotFit, SpillPlan, measure_layers, partition, state_bytes_per_param

CPU = torch.device("cpu")
STEPS = 20
MODEL = ModelSpec(kind="gpt", layers=3, d_model=32, heads=4, seq_len=16)
ADAMW = TrainSpec(steps=STEPS, batch_size=4, lr=1e-2, optimizer="adamw", weight_decay=0.1)
SGD = TrainSpec(steps=STEPS, batch_size=4, lr=0.1, optimizer="sgd", momentum=0.9)


@pytest.fixture(autouse=True)
def one_thread() -> None:
    # the machine's two cores are shared; tiny models gain nothing from intra-op threads
    torch.set_num_threads(1)


def make_stream() -> BatchStream:
    data = TextData.from_config(DataSpec(max_chars=100_000), seq_len=MODEL.seq_len)
    return BatchStream(data=data, batch_size=4, seed=0)


@pytest.fixture(scope="module")
def stream() -> BatchStream:
    return make_stream()


def resident_run(
    mcfg: ModelSpec, tcfg: TrainSpec, stream: BatchStream, *, steps: int = STEPS
) -> tuple[list[float], nn.Module]:
    """trainer/loop.py's step, verbatim: the reference (cached: many tests share it)."""
    assert stream.batch_size == tcfg.batch_size and stream.seed == tcfg.seed
    key = (repr(mcfg), repr(tcfg), steps)
    if key not in _RESIDENT:
        _RESIDENT[key] = _resident_run(mcfg, tcfg, stream, steps)
    return _RESIDENT[key]


_RESIDENT: dict[tuple[str, str, int], tuple[list[float], nn.Module]] = {}


def _resident_run(
    mcfg: ModelSpec, tcfg: TrainSpec, stream: BatchStream, steps: int
) -> tuple[list[float], nn.Module]:
    model = build_model(mcfg, seed=tcfg.seed)
    opt = build_optimizer(model.parameters(), tcfg)
    losses = []
    for step in range(steps):
        x, y = stream.batch_for(step)
        loss = lm_loss(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, model


def make_engine(
    mcfg: ModelSpec,
    tcfg: TrainSpec,
    *,
    cuts: list[int] | None = None,
    budget: int | None = None,
    prefetch: bool = True,
    offload: OffloadSpec | None = None,
    strict: bool = True,
    bucket_numel: int = 1000,
    reserved: int = 0,
) -> tuple[SpillEngine, SpillPlan, DeviceLedger]:
    model = build_model(mcfg, seed=tcfg.seed)
    offloaded = offload is not None and offload.optimizer
    costs = measure_layers(
        model,
        batch_size=tcfg.batch_size,
        seq_len=mcfg.seq_len,
        param_dtype=DTYPES[offload.dtype] if offloaded else torch.float32,
        state_bpp=state_bytes_per_param(optimizer=tcfg.optimizer, momentum=tcfg.momentum, offload=offloaded),
    )
    extra = bucket_bytes(bucket_numel) if offloaded else 0
    plan = partition(
        costs, budget_bytes=budget, prefetch=prefetch, cuts=cuts, extra_bytes=extra, reserved_bytes=reserved
    )
    ledger = DeviceLedger(budget_bytes=budget, strict=strict)
    engine = SpillEngine(
        model,
        plan=plan,
        train=tcfg,
        device=CPU,
        ledger=ledger,
        prefetch=prefetch,
        offload=offload,
        bucket_numel=bucket_numel,
    )
    return engine, plan, ledger


def spilled_run(engine: SpillEngine, stream: BatchStream, *, steps: int = STEPS) -> list[float]:
    return [engine.train_step(*stream.batch_for(step)) for step in range(steps)]


def assert_same_params(engine: SpillEngine, model: nn.Module, **tol: float) -> None:
    got = engine.model_state()
    for name, p in model.named_parameters():
        torch.testing.assert_close(got[name], p.detach(), **tol, msg=lambda m, n=name: f"{n}: {m}")


N_LAYERS = MODEL.layers + 2  # embedding + blocks + head
CUTS = {
    "one-shard": [],
    "two-shards": [2],
    "three-shards": [1, 3],
    "one-layer-per-shard": list(range(1, N_LAYERS)),
}


@pytest.mark.parametrize("tcfg", [ADAMW, SGD], ids=["adamw", "sgd-momentum"])
@pytest.mark.parametrize("cuts", list(CUTS.values()), ids=list(CUTS))
@pytest.mark.parametrize("prefetch", [True, False], ids=["prefetch", "no-prefetch"])
def test_spilled_training_equals_resident(
    stream: BatchStream, tcfg: TrainSpec, cuts: list[int], prefetch: bool
) -> None:
    ref_losses, ref_model = resident_run(MODEL, tcfg, stream)
    engine, plan, ledger = make_engine(MODEL, tcfg, cuts=cuts, prefetch=prefetch, strict=False)
    losses = spilled_run(engine, stream)
    assert plan.n_shards == len(cuts) + 1
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses))
    assert_same_params(engine, ref_model)
    # the planned peak (meta estimate) bounds what the engine really held
    assert 0 < ledger.peak <= plan.peak_bytes
    # shard 0 starts the next step without a copy; everything else is spilled
    assert engine.resident() == [0]


def test_plain_sgd_without_state(stream: BatchStream) -> None:
    tcfg = TrainSpec(steps=STEPS, batch_size=4, lr=0.1, optimizer="sgd")
    ref_losses, ref_model = resident_run(MODEL, tcfg, stream, steps=10)
    engine, _, ledger = make_engine(MODEL, tcfg, cuts=[1, 2, 3, 4], strict=False)
    losses = spilled_run(engine, stream, steps=10)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses))
    assert_same_params(engine, ref_model)
    assert not any(k.endswith(".state") for k, _ in ledger.entries.items())


def test_ledger_peak_stays_under_the_budget(stream: BatchStream) -> None:
    # a budget that forces several shards; the strict ledger raises the moment it is passed
    model = build_model(MODEL, seed=0)
    costs = measure_layers(model, batch_size=4, seq_len=16, state_bpp=8)
    whole = partition(costs, budget_bytes=None, prefetch=True, cuts=[]).peak_bytes
    finest = partition(costs, budget_bytes=None, prefetch=True, cuts=list(range(1, N_LAYERS))).peak_bytes
    budget = int(finest * 1.1)
    assert budget < whole  # resident training would not fit
    engine, plan, ledger = make_engine(MODEL, ADAMW, budget=budget, strict=True)
    assert plan.n_shards >= 3
    spilled_run(engine, stream, steps=5)
    assert ledger.peak <= budget
    assert max(h for _, _, h in ledger.timeline()) == ledger.peak
    assert ledger.resident_peak == 2  # the running shard and the prefetched one


def test_reserved_workspaces_are_held_in_the_ledger_beside_the_shards(stream: BatchStream) -> None:
    """On CUDA the plan reserves the math libraries' workspaces (measured; none on CPU, so a size is
    given here): the engine holds them in its ledger for the whole run, so the strict ledger checks
    shards + workspaces against the budget, and the plan's peak is the ledger's."""
    model = build_model(MODEL, seed=0)
    costs = measure_layers(model, batch_size=4, seq_len=16, state_bpp=8)
    finest = partition(costs, budget_bytes=None, prefetch=True, cuts=list(range(1, N_LAYERS))).peak_bytes
    budget, reserved = int(finest * 1.1), int(finest * 0.5)
    engine, plan, ledger = make_engine(MODEL, ADAMW, budget=budget + reserved, reserved=reserved, strict=True)
    alone, _, ledger_alone = make_engine(MODEL, ADAMW, budget=budget, strict=True)
    assert plan.cuts == alone.plan.cuts and plan.peak_bytes == alone.plan.peak_bytes + reserved
    spilled_run(engine, stream, steps=2)
    spilled_run(alone, stream, steps=2)
    assert ledger.entries["library.workspace"] == reserved
    assert ledger.peak == ledger_alone.peak + reserved <= plan.peak_bytes
    # the same budget without room for the workspaces: the strict ledger would trip, so the plan
    # refuses first
    with pytest.raises(DoesNotFit, match="library workspace"):
        make_engine(MODEL, ADAMW, budget=budget, reserved=reserved, strict=True)


def test_strict_ledger_catches_a_plan_over_budget(stream: BatchStream) -> None:
    """The ledger is a real check: a hand-given plan that holds too much trips it."""
    engine, plan, ledger = make_engine(MODEL, ADAMW, cuts=[], strict=False)
    ledger.budget_bytes = plan.peak_bytes // 3
    ledger.strict = True
    with pytest.raises(BudgetExceeded, match="budget"):
        engine.train_step(*stream.batch_for(0))


def test_model_four_times_the_budget_trains() -> None:
    """AdamW in fp32 (16 bytes/param on the device while a shard steps), no prefetch: the fp32
    parameters alone are >= 4x the budget, and training matches resident training."""
    mcfg = ModelSpec(kind="gpt", layers=20, d_model=64, heads=4, seq_len=8)
    tcfg = TrainSpec(steps=20, batch_size=2, lr=3e-3, optimizer="adamw")
    data = TextData.from_config(DataSpec(max_chars=100_000), seq_len=mcfg.seq_len)
    stream = BatchStream(data=data, batch_size=2, seed=0)
    model = build_model(mcfg, seed=0)
    costs = measure_layers(model, batch_size=2, seq_len=8, state_bpp=8)
    one_layer = list(range(1, len(costs)))
    min_budget = partition(costs, budget_bytes=None, prefetch=False, cuts=one_layer).peak_bytes
    budget = int(min_budget * 1.05)
    param_bytes = 4 * count_params(model)
    assert param_bytes >= 4 * budget, (param_bytes, budget)
    engine, plan, ledger = make_engine(mcfg, tcfg, budget=budget, prefetch=False, strict=True)
    losses = spilled_run(engine, stream, steps=20)
    ref_losses, ref_model = resident_run(mcfg, tcfg, stream, steps=20)
    assert ledger.peak <= budget
    assert plan.n_shards >= 8
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses))
    assert_same_params(engine, ref_model)
    assert losses[-1] < losses[0] - 0.5


@pytest.mark.parametrize("cuts", [[], [2], [1, 2, 3, 4]], ids=["1", "2", "5"])
def test_spilled_offload_fp32_equals_resident_adamw(stream: BatchStream, cuts: list[int]) -> None:
    ref_losses, ref_model = resident_run(MODEL, ADAMW, stream)
    engine, plan, ledger = make_engine(
        MODEL, ADAMW, cuts=cuts, offload=OffloadSpec(optimizer=True, dtype="fp32"), strict=False
    )
    losses = spilled_run(engine, stream)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses))
    assert_same_params(engine, ref_model)
    assert ledger.peak <= plan.peak_bytes


def test_spilled_offload_bf16_matches_unspilled_offload_and_tracks_fp32(stream: BatchStream) -> None:
    bf16 = OffloadSpec(optimizer=True, dtype="bf16")
    whole, _, _ = make_engine(MODEL, ADAMW, cuts=[], offload=bf16, strict=False)
    split, _, _ = make_engine(MODEL, ADAMW, cuts=[1, 2, 3, 4], offload=bf16, strict=False)
    a, b = spilled_run(whole, stream), spilled_run(split, stream)
    # the per-element arithmetic does not depend on where the shard boundaries are
    assert a == b
    torch.testing.assert_close(whole.model_state(), split.model_state(), rtol=0, atol=0)
    ref_losses, _ = resident_run(MODEL, ADAMW, stream)
    # mixed precision: close step by step at first; at lr 1e-2 the trajectories then drift apart
    # (a loss spike lands one step earlier or later), so later only the level is compared
    torch.testing.assert_close(torch.tensor(a[:12]), torch.tensor(ref_losses[:12]), rtol=0, atol=0.02)
    assert abs(sum(a[-5:]) - sum(ref_losses[-5:])) / 5 < 0.15


def test_offload_device_bytes_per_param(stream: BatchStream) -> None:
    """bf16 parameters + bf16 gradients = 4 bytes/param on the device; fp32 master weights and
    moments never are (the bucket buffers are a fixed extra). Measured by a census of the storages
    the kernels of a real training step computed on (tests/device_census.py), not read from the
    ledger: when the optimizer step begins, and after the step."""
    engine, _, ledger = make_engine(MODEL, ADAMW, cuts=[], offload=OffloadSpec(optimizer=True), strict=False)
    assert engine.opt is not None
    n = count_params(build_model(MODEL, seed=0))
    engine.train_step(*stream.batch_for(0))  # the first step; the census watches the second
    at_step: list[list[Seen]] = []
    made_by_optimizer: list[Seen] = []
    opt = engine.opt

    def watch(method: Any, *, snapshot: bool) -> Any:
        def watched(*args: Any, **kwargs: Any) -> Any:
            if snapshot:
                at_step.append(census.live())
            known = set(census.seen)
            out = method(*args, **kwargs)
            made_by_optimizer.extend(s for r, s in census.seen.items() if r not in known)
            return out

        return watched

    opt.found_inf = watch(opt.found_inf, snapshot=False)  # type: ignore[method-assign]
    opt.step_group = watch(opt.step_group, snapshot=True)  # type: ignore[method-assign]
    with DeviceCensus(CPU) as census:
        engine.train_step(*stream.batch_for(1))
    # the inf check and the update compute on nothing bigger than a bucket (no whole-gradient
    # temporaries: the device holds params + grads + buckets at the step, not more)
    bucket = 4 * opt.bucket_numel
    assert made_by_optimizer and max(s.nbytes for s in made_by_optimizer) <= bucket
    # when the step begins: the parameters and the gradients (bf16, 2 bytes/param each) and, besides
    # them, only the scalar loss
    (live,) = at_step
    big = sorted((s.dtype, s.nbytes) for s in live if s.nbytes >= 1024)
    assert big == [(torch.bfloat16, 2 * n), (torch.bfloat16, 2 * n)], big
    assert sum(s.nbytes for s in live if s.nbytes < 1024) <= 16
    # after the step: the parameters and the bucket buffers, nothing else
    after = census.alive()
    assert census.alive_bytes(torch.bfloat16) == 2 * n
    assert census.alive_bytes(torch.float32) == engine.opt.device_bytes == ledger.entries["offload.buckets"]
    assert {s.dtype for s in after} == {torch.bfloat16, torch.float32}
    # no kernel ever computed on a full fp32 copy (a master or a moment) or on the host state
    assert max(s.nbytes for s in census.seen.values() if s.dtype == torch.float32) < 4 * n
    host = [engine.shards[0].host, *engine.opt.exp_avg, *engine.opt.exp_avg_sq, *engine.opt.host_lp]
    assert not any(census.holds(t) for t in host)


def test_state_dict_round_trip_across_cuts(stream: BatchStream) -> None:
    """10 steps, save, load into an engine with other cuts, 10 more = 20 straight."""
    first, _, _ = make_engine(MODEL, ADAMW, cuts=[2], strict=False)
    l1 = spilled_run(first, stream, steps=10)
    sd = first.state_dict()
    second, _, _ = make_engine(MODEL, ADAMW, cuts=[1, 3, 4], strict=False)
    second.load_state_dict(sd)
    l2 = [second.train_step(*stream.batch_for(s)) for s in range(10, 20)]
    ref_losses, ref_model = resident_run(MODEL, ADAMW, stream)
    torch.testing.assert_close(torch.tensor(l1 + l2), torch.tensor(ref_losses))
    assert_same_params(second, ref_model)


@pytest.mark.parametrize("prefetch", [True, False], ids=["prefetch", "no-prefetch"])
@pytest.mark.parametrize("cuts", [[], [1, 3], [1, 2, 3, 4]], ids=["1", "3", "5"])
def test_grad_clip_equals_resident_clip(stream: BatchStream, cuts: list[int], prefetch: bool) -> None:
    """Global-norm clipping needs every gradient first: with several shards the engine parks them
    in host memory and steps after the whole backward (the deferred path), to the same numbers."""
    tcfg = TrainSpec(steps=STEPS, batch_size=4, lr=1e-2, optimizer="adamw", grad_clip=0.5)
    model = build_model(MODEL, seed=0)
    opt = build_optimizer(model.parameters(), tcfg)
    ref_losses = []
    for step in range(10):
        x, y = stream.batch_for(step)
        loss = lm_loss(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), tcfg.grad_clip)  # as trainer/loop.py
        opt.step()
        ref_losses.append(loss.item())
    engine, plan, ledger = make_engine(MODEL, tcfg, cuts=cuts, prefetch=prefetch, strict=False)
    assert engine.deferred == (len(cuts) > 0)
    losses = spilled_run(engine, stream, steps=10)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses))
    assert_same_params(engine, model)
    assert ledger.peak <= plan.peak_bytes


def test_eval_loss_equals_resident_forward(stream: BatchStream) -> None:
    engine, _, _ = make_engine(MODEL, ADAMW, cuts=[1, 3])
    model = build_model(MODEL, seed=0)
    x, y = stream.batch_for(0)
    with torch.no_grad():
        ref = lm_loss(model(x), y).item()
    assert engine.eval_loss(x, y) == pytest.approx(ref, rel=1e-6)
    assert engine.resident() == [0]
