"""`parallel.spill.optimizer: "host"`: a spilled shard's optimizer state stays in host memory and the
CPU steps it (trainer/spill/host_step.py). The run must equal resident training with the same
optimizer (torch's fused kernel) bit for bit, hold no optimizer state on the device but the anchor's
(shard 0), and keep every other contract of the engine: clipping, checkpoints, eval, the ledger.
Device = CPU here, through the same code path as CUDA; the copy streams and their overlap are
checked on a GPU by `make gpu-check` (tests/trainer/test_gpu_paths.py)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from jobrules.sizing import layer_working_sets, spec_problems
from jobrules.spec import DataSpec, JobSpec, ModelSpec, OffloadSpec, SelectionCreate, SpecError, TrainSpec
from trainer.data import BatchStream, TextData
from trainer.models import build_model, lm_loss
from trainer.optim import build_optimizer
from trainer.selection.shards import ShardedTrial
from trainer.spill.engine import SpillEngine
from trainer.spill.host_step import host_optimizer
from trainer.spill.ledger import DeviceLedger
from trainer.spill.partition import measure_layers, partition, state_bytes_per_param

CPU = torch.device("cpu")
STEPS = 12
MODEL = ModelSpec(kind="gpt", layers=3, d_model=32, heads=4, seq_len=16)
ADAMW = TrainSpec(steps=STEPS, batch_size=4, lr=1e-2, optimizer="adamw", weight_decay=0.1)
SGD = TrainSpec(steps=STEPS, batch_size=4, lr=0.1, optimizer="sgd", momentum=0.9)
N_LAYERS = MODEL.layers + 2
EXACT = {"atol": 0.0, "rtol": 0.0}


@pytest.fixture(autouse=True)
def one_thread() -> None:
    torch.set_num_threads(1)


@pytest.fixture(scope="module")
def stream() -> BatchStream:
    data = TextData.from_config(DataSpec(max_chars=100_000), seq_len=MODEL.seq_len)
    return BatchStream(data=data, batch_size=4, seed=0)


def resident(
    tcfg: TrainSpec, stream: BatchStream, *, steps: int = STEPS, anchor: int = 0
) -> tuple[list[float], nn.Module]:
    """Resident training, each parameter stepped by the optimizer the engine gives it: the first
    `anchor` layers (shard 0, stepped on the device) by trainer.optim's, the rest by the host's
    (torch's fused kernel); global-norm clipping as trainer/loop.py clips. The reference."""
    model = build_model(MODEL, seed=tcfg.seed)
    on_device = [p for layer in model[:anchor] for p in layer.parameters()]
    on_host = [p for layer in model[anchor:] for p in layer.parameters()]
    opts = [host_optimizer(on_host, tcfg)] + ([build_optimizer(on_device, tcfg)] if on_device else [])
    losses = []
    for step in range(steps):
        x, y = stream.batch_for(step)
        loss = lm_loss(model(x), y)
        model.zero_grad(set_to_none=True)
        loss.backward()
        if tcfg.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), tcfg.grad_clip)
        for opt in opts:
            opt.step()
        losses.append(loss.item())
    return losses, model


def host_engine(
    tcfg: TrainSpec, *, cuts: list[int] | None, prefetch: bool = True, budget: int | None = None
) -> tuple[SpillEngine, DeviceLedger]:
    model = build_model(MODEL, seed=tcfg.seed)
    costs = measure_layers(
        model,
        batch_size=tcfg.batch_size,
        seq_len=MODEL.seq_len,
        state_bpp=state_bytes_per_param(optimizer=tcfg.optimizer, momentum=tcfg.momentum, offload=True),
    )
    plan = partition(costs, budget_bytes=budget, prefetch=prefetch, cuts=cuts)
    ledger = DeviceLedger(budget_bytes=budget, strict=budget is not None)
    engine = SpillEngine(
        model, plan=plan, train=tcfg, device=CPU, ledger=ledger, prefetch=prefetch, host_step=True
    )
    return engine, ledger


def check_same(engine: SpillEngine, model: nn.Module) -> None:
    got = engine.model_state()
    for name, p in model.named_parameters():
        torch.testing.assert_close(got[name], p.detach(), **EXACT, msg=lambda m, n=name: f"{n}: {m}")


CUTS = {"two-shards": [2], "three-shards": [1, 3], "one-layer-per-shard": list(range(1, N_LAYERS))}


@pytest.mark.parametrize("tcfg", [ADAMW, SGD], ids=["adamw", "sgd-momentum"])
@pytest.mark.parametrize("cuts", list(CUTS.values()), ids=list(CUTS))
@pytest.mark.parametrize("prefetch", [True, False], ids=["prefetch", "no-prefetch"])
def test_host_steps_equal_resident_training(
    stream: BatchStream, tcfg: TrainSpec, cuts: list[int], prefetch: bool
) -> None:
    ref_losses, ref_model = resident(tcfg, stream, anchor=cuts[0])
    engine, ledger = host_engine(tcfg, cuts=cuts, prefetch=prefetch)
    losses = [engine.train_step(*stream.batch_for(s)) for s in range(STEPS)]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), **EXACT)
    check_same(engine, ref_model)
    # shard 0 is the anchor: its state is on the device, and no other shard's ever is
    assert engine.anchor and engine.resident() == [0]
    states = {k for _, k, _ in ledger.timeline() if k.endswith(".state")}
    assert states <= {"s0.state"}
    engine.close()


@pytest.mark.parametrize("cuts", [[2], [1, 3]], ids=["two-shards", "three-shards"])
def test_host_steps_clip_by_the_global_norm(stream: BatchStream, cuts: list[int]) -> None:
    tcfg = ADAMW.model_copy(update={"grad_clip": 0.05})
    ref_losses, ref_model = resident(tcfg, stream, anchor=cuts[0])
    engine, _ = host_engine(tcfg, cuts=cuts)
    assert engine.deferred
    losses = [engine.train_step(*stream.batch_for(s)) for s in range(STEPS)]
    # the norm is summed in another order than clip_grad_norm_'s, so the coefficient can differ
    # in its last bit
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), atol=1e-6, rtol=1e-6)
    got = engine.model_state()
    for name, p in ref_model.named_parameters():
        torch.testing.assert_close(got[name], p.detach(), atol=1e-6, rtol=1e-5)
    engine.close()


def test_a_checkpoint_moves_between_host_and_device_steps(stream: BatchStream) -> None:
    """Half the run with host steps, the rest resumed from its state_dict on the device-stepped
    engine with other cuts: the same as one resident run (the state is keyed by name)."""
    ref_losses, ref_model = resident(ADAMW, stream, anchor=1)
    first, _ = host_engine(ADAMW, cuts=[1, 3])
    losses = [first.train_step(*stream.batch_for(s)) for s in range(STEPS // 2)]
    sd = first.state_dict()
    first.close()
    second, _ = host_engine(ADAMW, cuts=[1, 2])
    second.load_state_dict(sd)
    losses += [second.train_step(*stream.batch_for(s)) for s in range(STEPS // 2, STEPS)]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), **EXACT)
    check_same(second, ref_model)
    second.close()


def test_eval_between_steps_changes_nothing(stream: BatchStream) -> None:
    ref_losses, ref_model = resident(ADAMW, stream, steps=6, anchor=1)
    engine, _ = host_engine(ADAMW, cuts=[1, 3])
    losses = []
    for s in range(6):
        losses.append(engine.train_step(*stream.batch_for(s)))
        x, y = stream.batch_for(100 + s)
        with torch.no_grad():
            want = lm_loss(_copy_of(engine)(x), y).item()
        assert engine.eval_loss(x, y) == pytest.approx(want, abs=1e-6)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), **EXACT)
    check_same(engine, ref_model)
    engine.close()


def _copy_of(engine: SpillEngine) -> nn.Module:
    model = build_model(MODEL, seed=0)
    model.load_state_dict(engine.model_state())
    return model


def test_host_state_lets_a_tighter_budget_hold_fewer_shards(stream: BatchStream) -> None:
    """Without the state on the device a shard's working set is smaller: the budget that needs one
    layer per shard with the state on the device holds larger shards, the strict ledger stays under
    it, and where the anchor does not fit beside the others, shard 0 steps on the host too."""
    model = build_model(MODEL, seed=0)
    dev_costs = measure_layers(model, batch_size=4, seq_len=16, state_bpp=8)
    finest = partition(dev_costs, budget_bytes=None, prefetch=True, cuts=list(range(1, N_LAYERS)))
    budget = int(finest.peak_bytes * 1.02)
    device_plan = partition(dev_costs, budget_bytes=budget, prefetch=True)
    engine, ledger = host_engine(ADAMW, cuts=None, budget=budget)
    assert engine.plan.n_shards < device_plan.n_shards
    anchor = engine.plan.cuts[0] if engine.anchor else 0
    ref_losses, ref_model = resident(ADAMW, stream, steps=6, anchor=anchor)
    losses = [engine.train_step(*stream.batch_for(s)) for s in range(6)]
    assert ledger.peak <= budget
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), **EXACT)
    check_same(engine, ref_model)
    engine.close()
    # a budget with no room for the anchor: every shard steps on the host, and still exactly
    host_costs = measure_layers(model, batch_size=4, seq_len=16, state_bpp=0)
    tight = partition(host_costs, budget_bytes=None, prefetch=True, cuts=list(range(1, N_LAYERS))).peak_bytes
    engine, ledger = host_engine(ADAMW, cuts=None, budget=int(tight * 1.01))
    assert not engine.anchor and engine.host is not None
    ref_losses, ref_model = resident(ADAMW, stream, steps=6)
    losses = [engine.train_step(*stream.batch_for(s)) for s in range(6)]
    assert ledger.peak <= int(tight * 1.01)
    assert not any(k.endswith(".state") for _, k, _ in ledger.timeline())
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), **EXACT)
    check_same(engine, ref_model)
    engine.close()


def test_a_failing_host_step_is_raised_in_the_training_thread(stream: BatchStream) -> None:
    engine, _ = host_engine(ADAMW, cuts=[1, 3])
    assert engine.host is not None
    chunk = engine.host.chunks[2][0]

    def broken() -> None:
        raise RuntimeError("host step broke")

    chunk.opt.step = broken  # type: ignore[method-assign]
    with pytest.raises(RuntimeError, match="host step broke"):
        for s in range(3):
            engine.train_step(*stream.batch_for(s))


def test_a_selection_batch_refuses_host_steps() -> None:
    """Shard alternation moves a trial's shards between devices with their state: a batch whose
    base asks for host steps is refused at submit, and a trial the space gives them fails alone."""
    base = {
        "model": MODEL.model_dump(),
        "train": ADAMW.model_dump(),
        "parallel": {"spill": {"device_budget_mb": 64, "optimizer": "host"}},
    }
    with pytest.raises(ValueError, match='parallel.spill.optimizer "host" is for single jobs'):
        SelectionCreate.model_validate({"base": base, "space": {"train.lr": [0.1, 0.01]}, "method": "grid"})
    with pytest.raises(SpecError, match='parallel.spill.optimizer "host" is for single jobs'):
        ShardedTrial.build(JobSpec.model_validate(base), index=0, budget_bytes=None, prefetch=False)


def test_the_spec_names_the_conflict_with_the_offloaded_optimizer() -> None:
    doc = {
        "model": MODEL.model_dump(),
        "train": ADAMW.model_dump(),
        "data": DataSpec().model_dump(),
        "parallel": {
            "spill": {"device_budget_mb": 64, "optimizer": "host"},
            "offload": OffloadSpec(optimizer=True).model_dump(),
        },
    }
    problems = spec_problems(
        JobSpec.model_validate({**doc, "parallel": {}}).model_dump() | {"parallel": doc["parallel"]}
    )
    assert any('parallel.spill.optimizer "host"' in p and "choose one" in p for p in problems)
    # and the device holds no state for a layer whose state is on the host
    shape = {"kind": "gpt", "layers": 3, "d_model": 32, "heads": 4, "seq_len": 16, "batch_size": 4}
    on_device = layer_working_sets(**shape)
    on_host = layer_working_sets(**shape, host_state=True)
    assert all(h < d for h, d in zip(on_host, on_device, strict=True))


def test_the_state_stays_on_the_host_unless_asked_or_streamed() -> None:
    """`auto` (the default): host for a spilled job; the device where the offloaded optimizer
    streams the state, or where asked; never for a job without spilling."""

    def on_host(parallel: dict) -> bool:
        return JobSpec.model_validate({"parallel": parallel}).parallel.spill_state_on_host

    spill = {"device_budget_mb": 64}
    assert on_host({"spill": spill})
    assert on_host({"spill": {**spill, "optimizer": "host"}})
    assert not on_host({"spill": {**spill, "optimizer": "device"}})
    assert not on_host({"spill": spill, "offload": {"optimizer": True}})
    assert not on_host({"offload": {"optimizer": True}})
    assert not on_host({})


def test_a_selection_trial_with_the_default_keeps_its_state_with_its_shards() -> None:
    job = JobSpec.model_validate(
        {
            "model": MODEL.model_dump(),
            "train": ADAMW.model_dump(),
            "parallel": {"spill": {"device_budget_mb": 64}},
        }
    )
    trial = ShardedTrial.build(job, index=0, budget_bytes=None, prefetch=False)
    assert all(s.opt is not None and s.state_host for s in trial.shards)
