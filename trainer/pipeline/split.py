"""Zero-bubble split backward: B computes the stage input's gradient, W the weight gradients.

During a split stage's forward, every `F.linear` whose weight belongs to the stage runs as
`_DeferredLinear`: its backward returns the input gradient only and records (input, output
gradient, weight, bias). B is then one ordinary backward from the stage output: it yields the
input gradient to send upstream, and the gradients of the parameters that are not linear weights
(layer norms, embeddings), which are elementwise and cheap. W turns each record into its weight
gradient with one matrix product (dW = dY^T X, db = sum dY), with no autograd graph and no graph
walk. B + W together do exactly the work of one backward, and W costs one matmul per linear.

Any parameter that is not the weight or bias of an intercepted `F.linear` keeps its gradient in
B, so the split is correct for every model; it only becomes cheaper the more of the stage's
weights sit in linear layers (all of GPT's and LLaMA's matmul weights do, tensor-parallel ones
included, since those call `F.linear` on their local shard).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

Record = tuple[torch.Tensor, torch.Tensor, nn.Parameter, nn.Parameter | None]


class _DeferredLinear(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: Any, records: list[Record]
    ) -> torch.Tensor:
        ctx.save_for_backward(x)
        # the parameters themselves, not saved tensors: under a saved-tensor hook (activation
        # offloading) a saved one unpacks as a new tensor, and W's `.grad` would land on that
        ctx.weight, ctx.bias, ctx.records = weight, bias, records
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor | None, None, None, None]:
        (x,) = ctx.saved_tensors
        # detached: the unpacked input still has its forward's grad_fn, whose chain holds the stage
        # input (its AccumulateGrad) until W
        ctx.records.append((x.detach(), dy, ctx.weight, ctx.bias))
        dx = dy @ ctx.weight.to(dy.dtype) if ctx.needs_input_grad[0] else None
        return dx, None, None, None


class DeferLinearWeightGrads(TorchFunctionMode):
    """Inside this mode, `F.linear` on one of `params` (as weight, with an owned bias or none)
    defers its weight and bias gradients to `records`; everything else runs unchanged."""

    def __init__(self, params: set[int], records: list[Record]) -> None:
        super().__init__()
        self.params = params
        self.records = records

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is F.linear and torch.is_grad_enabled():
            named = dict(zip(("input", "weight", "bias"), args, strict=False)) | kwargs
            w, b = named.get("weight"), named.get("bias")
            if id(w) in self.params and (b is None or id(b) in self.params):
                return _DeferredLinear.apply(named["input"], w, b, self.records)
        return func(*args, **kwargs)


_NO_LINEAR = (nn.LayerNorm, nn.Embedding, nn.RMSNorm)
"""Module types whose parameters never go through `F.linear`."""


def plain_linears(module: nn.Module) -> list[nn.Linear] | None:
    """The stage's `nn.Linear` modules when every trainable parameter sits directly in one of
    them or in a module that calls no linear (norms, embeddings); None when some parameter may
    reach `F.linear` another way (a custom or tensor-parallel layer), which needs the mode."""
    linears: list[nn.Linear] = []
    for sub in module.modules():
        own = [p for p in sub.parameters(recurse=False) if p.requires_grad]
        if type(sub) is nn.Linear and "forward" not in vars(sub) and own == list(sub.parameters()):
            linears.append(sub)
        elif own and not isinstance(sub, _NO_LINEAR):
            return None
    return linears


@contextmanager
def defer_weight_grads(
    module: nn.Module, params: set[int], records: list[Record], linears: list[nn.Linear] | None
) -> Iterator[None]:
    """The split forward of a stage. With `linears` (`plain_linears(module)`), each of them runs
    `_DeferredLinear` for the duration, swapped in as the instance's forward: the forward then
    costs what a plain one does (the torch-function mode sees every op of the forward, 0.55 ms
    on a 0.7 ms tiny GPT stage, about 6% of a 6x128 one). Otherwise the mode catches every
    `F.linear` on one of `params`."""
    if linears is None:
        with DeferLinearWeightGrads(params, records):
            yield
        return
    for lin in linears:
        lin.forward = _deferred_forward(lin, records)
    try:
        yield
    finally:
        for lin in linears:
            del lin.forward


def _deferred_forward(lin: nn.Linear, records: list[Record]) -> Any:
    def forward(x: torch.Tensor) -> torch.Tensor:
        if not torch.is_grad_enabled():
            return F.linear(x, lin.weight, lin.bias)
        return _DeferredLinear.apply(x, lin.weight, lin.bias, records)

    return forward


def param_ids(module: nn.Module) -> set[int]:
    return {id(p) for p in module.parameters() if p.requires_grad}


@torch.no_grad()
def weight_grads(records: list[Record]) -> None:
    """W: accumulate each recorded linear's weight (and bias) gradient into `.grad`. Without grad
    mode: a recorded input still has its forward's grad_fn, and a product with it would hang a
    graph on `.grad` that keeps every record alive until the next zero_grad."""
    for x, dy, weight, bias in records:
        dy_MO = dy.reshape(-1, dy.shape[-1])
        x_MI = x.reshape(-1, x.shape[-1]).to(dy.dtype)
        _accumulate(weight, (dy_MO.t() @ x_MI).to(weight.dtype))
        if bias is not None:
            _accumulate(bias, dy_MO.sum(0).to(bias.dtype))
    records.clear()


def _accumulate(p: nn.Parameter, g: torch.Tensor) -> None:
    if p.grad is None:
        p.grad = g
    else:
        p.grad.add_(g)
