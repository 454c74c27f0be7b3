"""chimera-zb's split backward costs one backward: B (input gradient) + W (weight gradients) is
measured with FlopCounterMode against a plain backward of the same stage, and gives the same
gradients. Runs the driver's own compute path (no processes: compute sends nothing)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from jobrules.spec import ModelSpec
from trainer.models import build_model
from trainer.pipeline.driver import PipelineDriver, _StepRun
from trainer.pipeline.schedules import Action, build_schedule
from trainer.pipeline.stage import build_stages

CFG = ModelSpec(layers=4, d_model=64, heads=4, seq_len=16, vocab_size=128)
D, N, BATCH = 4, 4, 8


def _flops(fn) -> int:  # noqa: ANN001
    with FlopCounterMode(display=False) as counter:
        fn()
    return counter.get_total_flops()


def _run(name: str, stage: int) -> tuple[dict[str, int], torch.Tensor | None, dict[str, torch.Tensor]]:
    """F, then B (and W) of micro-batch 0 on `stage`; flops per op, input gradient, weight grads."""
    sched = build_schedule(name, stages=D, microbatches=N)
    model = build_model(CFG, seed=0)
    modules = build_stages(model, sched=sched, rank=stage)
    ex = PipelineDriver(
        sched=sched, rank=stage, modules=modules, act_shape=(BATCH // N, CFG.seq_len, CFG.d_model)
    )
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, CFG.vocab_size, (BATCH, CFG.seq_len), generator=g)
    run = _StepRun(ex, xs=x.chunk(N), ys=x.chunk(N), t0=0.0)
    act = None if stage == 0 else torch.randn(BATCH // N, CFG.seq_len, CFG.d_model, generator=g)
    grad = None if stage == D - 1 else torch.randn(BATCH // N, CFG.seq_len, CFG.d_model, generator=g)
    run.compute(Action("F", 0, stage), act)
    out: list[torch.Tensor | None] = []
    flops = {"B": _flops(lambda: out.append(run.compute(Action("B", 0, stage), grad)))}
    if sched.split_backward:
        flops["W"] = _flops(lambda: run.compute(Action("W", 0, stage), None))
    mod = modules[(stage, 0)]
    return flops, out[0], {n: p.grad.clone() for n, p in mod.named_parameters()}


@pytest.mark.parametrize("stage", [0, 1, D - 1])
def test_split_backward_costs_one_backward_and_gives_the_same_gradients(stage: int) -> None:
    plain, plain_dx, plain_grads = _run("chimera", stage)
    split, split_dx, split_grads = _run("chimera-zb", stage)
    assert plain["B"] > 0
    assert split["B"] + split["W"] <= 1.05 * plain["B"], (split, plain)
    if 0 < stage:
        # B carries the input-gradient chain; W only the weight gradients
        assert split["B"] < plain["B"] and split["W"] < plain["B"]
        torch.testing.assert_close(split_dx, plain_dx)
    for n, g in plain_grads.items():
        torch.testing.assert_close(split_grads[n], g, msg=n)


class _Tied(torch.nn.Module):
    """One weight in two linear calls (the second through F.linear with a foreign bias, which is
    not deferred, so a.weight's gradient is part B and part W), a
    bias-less linear, a layer norm and an elementwise parameter: W must sum the deferred pieces,
    B must keep every gradient that is not an owned linear's."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(8, 8)
        self.b = torch.nn.Linear(8, 8, bias=False)
        self.ln = torch.nn.LayerNorm(8)
        self.scale = torch.nn.Parameter(torch.linspace(0.5, 1.5, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.nn.functional.gelu(self.a(self.ln(x)))
        h = torch.nn.functional.linear(h, self.a.weight, bias=torch.ones(8)) * self.scale
        return x + self.b(h)


def _split_stage_matches_autograd(layer: type[torch.nn.Module], after_b: Callable[[Any], None]) -> None:
    """F, B and W of one micro-batch on stage 1 of a 2-stage chimera-zb driver (loss: the mean
    square, over 2 micro-batches), `after_b` called on the layer between B and W; the input
    gradient and every parameter's gradient must equal plain autograd's."""
    torch.manual_seed(0)
    stage_mod = torch.nn.Sequential(layer())
    ref = torch.nn.Sequential(layer())
    ref.load_state_dict(stage_mod.state_dict())
    sched = build_schedule("chimera-zb", stages=2, microbatches=2)
    ex = PipelineDriver(sched=sched, rank=1, modules={(1, 0): stage_mod}, act_shape=(1, 4, 8))
    ex.loss_fn = lambda out, _y: out.square().mean()
    zeros = torch.zeros(2, 4, dtype=torch.long)
    run = _StepRun(ex, xs=torch.zeros(2, 4, 8).chunk(2), ys=zeros.chunk(2), t0=0.0)
    act = torch.randn(1, 4, 8)
    run.compute(Action("F", 0, 1), act)
    dx = run.compute(Action("B", 0, 1), None)
    after_b(stage_mod[0])
    run.compute(Action("W", 0, 1), None)

    inp = act.detach().clone().requires_grad_()
    (ref(inp).square().mean() / 2).backward()
    torch.testing.assert_close(dx, inp.grad)
    for (n, p), q in zip(stage_mod.named_parameters(), ref.parameters(), strict=True):
        assert p.grad is not None, n
        # a plain tensor: a graph on it would keep the records (every micro-batch's linear inputs
        # and output gradients) alive until the next zero_grad
        assert p.grad.grad_fn is None and not p.grad.requires_grad, n
        torch.testing.assert_close(p.grad, q.grad, msg=n)


def test_split_backward_of_shared_and_non_linear_parameters_matches_autograd() -> None:
    def after_b(m: _Tied) -> None:
        # B leaves the layer norm's and the elementwise parameter's gradients and the foreign-bias
        # call's share of a.weight; the owned linears' weight gradients wait for W
        assert m.ln.weight.grad is not None and m.scale.grad is not None and m.a.weight.grad is not None
        assert m.a.bias.grad is None and m.b.weight.grad is None

    _split_stage_matches_autograd(_Tied, after_b)


class _Offloaded(torch.nn.Module):
    """Two linears whose saved activations go to host memory (`save_on_cpu`, a saved-tensor hook,
    as a model offloading its activations would): a hook hands back a new tensor, not the
    parameter that was saved, so W must not take the parameter from the saved tensors."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(8, 8)
        self.b = torch.nn.Linear(8, 8, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autograd.graph.save_on_cpu():
            return self.b(torch.tanh(self.a(x)))


def test_split_backward_under_saved_tensor_hooks_matches_autograd() -> None:
    def after_b(m: _Offloaded) -> None:
        assert m.a.weight.grad is None and m.b.weight.grad is None  # deferred to W

    _split_stage_matches_autograd(_Offloaded, after_b)


def test_a_split_b_leaves_w_only_the_records() -> None:
    """Between a split stage's B and its W nothing holds the received activation (W needs only
    the records: chimera-zb delays W, so whatever it pins is held for that long)."""
    import gc
    import weakref

    sched = build_schedule("chimera-zb", stages=D, microbatches=N)
    modules = build_stages(build_model(CFG, seed=0), sched=sched, rank=1)
    ex = PipelineDriver(
        sched=sched, rank=1, modules=modules, act_shape=(BATCH // N, CFG.seq_len, CFG.d_model)
    )
    x = torch.randint(0, CFG.vocab_size, (BATCH, CFG.seq_len))
    run = _StepRun(ex, xs=x.chunk(N), ys=x.chunk(N), t0=0.0)
    act = torch.randn(BATCH // N, CFG.seq_len, CFG.d_model)
    received = weakref.ref(act)
    run.compute(Action("F", 0, 1), act)
    del act
    assert run.compute(Action("B", 0, 1), torch.randn(BATCH // N, CFG.seq_len, CFG.d_model)) is not None
    gc.collect()
    assert received() is None
    run.compute(Action("W", 0, 1), None)
    assert all(p.grad is not None for p in modules[(1, 0)].parameters())


def test_plain_linear_stages_skip_the_torch_function_mode() -> None:
    """A stage whose trainable parameters all sit in nn.Linear, norm or embedding modules swaps its
    linears' forwards (no per-op mode dispatch); one with any other parameter uses the mode.
    Both paths are checked against autograd above (_Offloaded: swap, _Tied: mode)."""
    from jobrules.spec import ModelSpec
    from trainer.models import build_model
    from trainer.pipeline.split import plain_linears

    gpt = build_model(ModelSpec(layers=2, d_model=32, heads=2, seq_len=16), seed=0)
    assert len(plain_linears(gpt)) == 2 * 4 + 1
    assert len(plain_linears(_Offloaded())) == 2
    assert plain_linears(_Tied()) is None
