"""Cut a model's ordered layers into shards that fit a device budget.

The rule (the same one the engine's ledger is checked against). For a shard s = layers [a, b):

    W(s)  = params + grads + optimizer state of its layers            (device dtype)
          + activations autograd saves when the shard is recomputed    (one micro-batch)
          + 2 x its boundary input (the device copy and its gradient)
          + its boundary output gradient (the upstream gradient)
          + fixed extras (the offloaded optimizer's bucket buffers)
          + reserved (on CUDA: the math libraries' workspaces, measured; see `library_workspace_bytes`)
    Pf(s) = params + optimizer state + boundary input of s             (what a prefetch copies in)

    peak  = max over shards s of  W(s) + max(Pf(s-1), Pf(s+1))         with prefetch (double buffering)
          = max over shards s of  W(s)                                  without prefetch

A plan fits when peak <= budget. With one layer per shard the peak is smallest, so "the largest single
layer's working set W(layer) exceeds the budget" is the condition under which no plan exists at all
(that is the rule the REST layer checks, see jobrules/sizing.py). Layer costs come from a trial
pass: on the meta device (no memory, no compute; an estimate that errs high) or on the real device
(measured; on CUDA also cross-checked against the allocator's peak).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch.func import functional_call

from jobrules.spec import SpecError
from trainer.models import lm_loss
from trainer.spill.ledger import MiB, SavedActivations


class DoesNotFit(SpecError):
    """No plan fits the budget; the message carries the numbers."""


@dataclass(kw_only=True, slots=True)
class LayerCost:
    """Device bytes of one layer for one micro-batch."""

    index: int
    name: str
    numel: int
    param_bytes: int
    grad_bytes: int
    state_bytes: int
    act_bytes: int
    """Saved for backward by this layer (its own input included, its parameters not)."""
    in_bytes: int
    out_bytes: int


@dataclass(kw_only=True, slots=True)
class SpillPlan:
    cuts: list[int]
    """Layer indices at which a new shard starts (the first shard starts at 0 and is not listed)."""
    n_layers: int
    peak_bytes: int
    """Planned peak device bytes (the rule above)."""
    budget_bytes: int | None
    prefetch: bool
    costs: list[LayerCost]
    reserved_bytes: int = 0
    """Device bytes held outside the shards for the whole run (`library_workspace_bytes`); inside
    `peak_bytes`, and entered in the engine's ledger as `library.workspace`."""

    @property
    def bounds(self) -> list[tuple[int, int]]:
        edges = [0, *self.cuts, self.n_layers]
        return list(zip(edges[:-1], edges[1:], strict=True))

    @property
    def n_shards(self) -> int:
        return len(self.cuts) + 1


def state_bytes_per_param(*, optimizer: str, momentum: float, offload: bool) -> int:
    """Optimizer state the device holds during a shard's step (fp32)."""
    if offload:
        return 0  # master weights and moments stay in host memory; buckets are counted as extras
    if optimizer == "adamw":
        return 8
    return 4 if momentum > 0 else 0


def library_workspace_bytes(device: torch.device | str) -> int:
    """On CUDA: the device bytes the math libraries keep for the rest of the process once training
    has run a matmul forward and backward. In the torch builds run on a GPU so far (2.11), cuBLAS
    and cuBLASLt take a workspace per (thread, stream) from torch's caching allocator and keep it:
    one for the thread that runs the forward, one for autograd's device thread that runs the
    backward, 32 MiB each on an H100 with torch's defaults. The ledger cannot see them (no tensor
    of ours holds them), so the planner reserves them in the budget. Measured, not assumed: the
    size depends on the GPU, the torch build (newer ones keep them only when asked) and the
    environment (CUBLAS_WORKSPACE_CONFIG, CUBLASLT_WORKSPACE_SIZE). The workspaces already held are
    cleared first, so the number is the whole of what the run holds, not what it adds. 0 off CUDA."""
    device = torch.device(device)
    if device.type != "cuda":
        return 0
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)  # private; absent: measure the rest
    torch.cuda.synchronize(device)
    if clear is not None:
        clear()
    before = torch.cuda.memory_allocated(device)
    with torch.cuda.device(device):
        w = torch.ones(64, 64, device=device, requires_grad=True)
        b = torch.ones(64, device=device, requires_grad=True)
        # a linear with a bias (cuBLASLt's path) and a plain matmul (cuBLAS's), through autograd
        (torch.nn.functional.linear(w, w, b) @ w).sum().backward()
        del w, b
    torch.cuda.synchronize(device)
    return max(0, torch.cuda.memory_allocated(device) - before)


def measure_layers(
    model: nn.Sequential,
    *,
    batch_size: int,
    seq_len: int,
    param_dtype: torch.dtype = torch.float32,
    state_bpp: int,
    device: torch.device | str = "meta",
    example: tuple[torch.Tensor, torch.Tensor] | None = None,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = lm_loss,
) -> list[LayerCost]:
    """Per-layer costs from a trial forward of one micro-batch, layer by layer.

    device="meta" needs no memory and runs no kernels (an estimate: meta picks the math attention
    kernel, which saves more than the fused ones). A real device measures what autograd saves there;
    on CUDA the allocator's peak over each layer's trial also bounds the activation count from below,
    so transient buffers larger than the saved set are seen too.

    `example` is one batch's (inputs, targets) as the recipe feeds them (a user model's inputs need
    not be token ids); without it, zero token ids of (batch_size, seq_len)."""
    device = torch.device(device)
    costs: list[LayerCost] = []
    elt = torch.empty((), dtype=param_dtype).element_size()
    if example is None:
        x = torch.zeros(batch_size, seq_len, dtype=torch.long, device=device)
        y = torch.zeros(batch_size, seq_len, dtype=torch.long, device=device)
    else:
        x, y = (t.to(device) for t in example)
    last = len(model) - 1
    for i, layer in enumerate(model):
        params = {
            n: p.detach().to(device=device, dtype=param_dtype).requires_grad_(True)
            for n, p in layer.named_parameters()
        }
        numel = sum(p.numel() for p in params.values())
        x_in = x if i == 0 else x.detach().requires_grad_(True)
        if device.type == "cuda":
            # one untimed trial first: what the first kernel of a kind allocates once per process
            # (cuBLAS's workspace, ~32 MiB on an H100) is not this layer's activations; charged to
            # the first Block it made a plan that fits refuse the budget (seen on the lent H100)
            warm = functional_call(layer, params, (x_in,))
            if i == last:
                loss_fn(warm, y)
            del warm
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
            base = torch.cuda.memory_allocated(device)  # this layer's parameters included
        with SavedActivations(exclude=list(params.values())) as saved:
            out = functional_call(layer, params, (x_in,))
            if i == last:
                loss = loss_fn(out, y)
        act = saved.nbytes
        if i == last:
            # the loss's own output and the logits' gradient buffer live during the backward
            act += out.numel() * 4 + loss.numel() * 4
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            act = max(act, torch.cuda.max_memory_allocated(device) - base)
        costs.append(
            LayerCost(
                index=i,
                name=type(layer).__name__,
                numel=numel,
                param_bytes=numel * elt,
                grad_bytes=numel * elt,
                state_bytes=numel * state_bpp,
                act_bytes=act,
                in_bytes=x_in.numel() * x_in.element_size(),
                out_bytes=out.numel() * out.element_size(),
            )
        )
        x = out.detach()
        del params, out
    return costs


def working_set(costs: list[LayerCost], *, start: int, stop: int, extra_bytes: int = 0) -> int:
    """W(s) for the shard [start, stop): see the module docstring."""
    layers = costs[start:stop]
    held = sum(c.param_bytes + c.grad_bytes + c.state_bytes + c.act_bytes for c in layers)
    out_grad = layers[-1].out_bytes if stop < len(costs) else 0  # the last shard starts the backward
    return held + 2 * layers[0].in_bytes + out_grad + extra_bytes


def prefetch_bytes(costs: list[LayerCost], *, start: int, stop: int) -> int:
    """Pf(s): what copying shard [start, stop) in ahead of its turn puts on the device."""
    return sum(c.param_bytes + c.state_bytes for c in costs[start:stop]) + costs[start].in_bytes


def plan_peak(
    costs: list[LayerCost], *, cuts: list[int], prefetch: bool, extra_bytes: int = 0
) -> tuple[int, int]:
    """(peak bytes, index of the shard where it occurs) of a plan under the rule above."""
    edges = [0, *cuts, len(costs)]
    bounds = list(zip(edges[:-1], edges[1:], strict=True))
    peak, where = 0, 0
    for s, (a, b) in enumerate(bounds):
        w = working_set(costs, start=a, stop=b, extra_bytes=extra_bytes)
        if prefetch:
            neighbours = [bounds[t] for t in (s - 1, s + 1) if 0 <= t < len(bounds)]
            w += max((prefetch_bytes(costs, start=na, stop=nb) for na, nb in neighbours), default=0)
        if w > peak:
            peak, where = w, s
    return peak, where


def check_cuts(cuts: list[int], *, n_layers: int) -> None:
    ok = all(0 < c < n_layers for c in cuts) and all(a < b for a, b in zip(cuts, cuts[1:], strict=False))
    if not ok:
        raise SpecError(
            f"parallel.spill.cuts must be strictly increasing layer indices in (0, {n_layers}), got {cuts}"
        )


def _describe_layer(c: LayerCost, *, extra_bytes: int, reserved_bytes: int) -> str:
    return (
        f"layer {c.index} ({c.name}, {c.numel:,} params) needs "
        f"params {c.param_bytes / MiB:.3f} + grads {c.grad_bytes / MiB:.3f} + optimizer "
        f"{c.state_bytes / MiB:.3f} + activations {c.act_bytes / MiB:.3f} + boundaries "
        f"{(2 * c.in_bytes + c.out_bytes) / MiB:.3f}"
        + (f" + offload buckets {extra_bytes / MiB:.3f}" if extra_bytes else "")
        + (f" + library workspaces {reserved_bytes / MiB:.3f} (cuBLAS, measured)" if reserved_bytes else "")
        + " MiB"
    )


def partition(
    costs: list[LayerCost],
    *,
    budget_bytes: int | None,
    prefetch: bool,
    cuts: list[int] | None = None,
    extra_bytes: int = 0,
    reserved_bytes: int = 0,
) -> SpillPlan:
    """Fewest shards (greedy, left to right) whose planned peak fits `budget_bytes`; or the
    hand-given `cuts`, checked. budget None: one shard (everything resident). `reserved_bytes`
    (the library workspaces) is held beside every shard for the whole run."""
    n = len(costs)
    fixed = extra_bytes + reserved_bytes
    if cuts is not None:
        check_cuts(cuts, n_layers=n)
        chosen = list(cuts)
    elif budget_bytes is None:
        chosen = []
    else:
        chosen = _greedy(costs, budget=budget_bytes, prefetch=prefetch, extra_bytes=fixed)
    peak, where = plan_peak(costs, cuts=chosen, prefetch=prefetch, extra_bytes=fixed)
    if budget_bytes is not None and peak > budget_bytes:
        single = [working_set(costs, start=i, stop=i + 1, extra_bytes=fixed) for i in range(n)]
        worst = max(range(n), key=single.__getitem__)
        budget_mb = budget_bytes / MiB
        if single[worst] > budget_bytes:
            raise DoesNotFit(
                f"parallel.spill.device_budget_mb ({budget_mb:.3f}) is smaller than one layer's working "
                f"set: {_describe_layer(costs[worst], extra_bytes=extra_bytes, reserved_bytes=reserved_bytes)}"
                f" = {single[worst] / MiB:.3f} MiB"
            )
        edges = [0, *chosen, n]
        raise DoesNotFit(
            f"the spill plan with cuts {chosen} needs {peak / MiB:.3f} MiB at shard {where} (layers "
            f"{edges[where]}..{edges[where + 1] - 1}"
            + (", plus the prefetched neighbour" if prefetch else "")
            + f") but parallel.spill.device_budget_mb is {budget_mb:.3f}"
            + (f", of which {reserved_bytes / MiB:.3f} MiB are library workspaces" if reserved_bytes else "")
            + ("; turn prefetch off or raise the budget" if prefetch else "")
        )
    return SpillPlan(
        cuts=chosen,
        n_layers=n,
        peak_bytes=peak,
        budget_bytes=budget_bytes,
        prefetch=prefetch,
        costs=costs,
        reserved_bytes=reserved_bytes,
    )


def _greedy(costs: list[LayerCost], *, budget: int, prefetch: bool, extra_bytes: int) -> list[int]:
    """Grow each shard while it still pairs with the previous shard and with at least a one-layer
    next shard; the final check in `partition` covers what this local rule cannot see."""
    n = len(costs)

    def ws(a: int, b: int) -> int:
        return working_set(costs, start=a, stop=b, extra_bytes=extra_bytes)

    def pf(a: int, b: int) -> int:
        return prefetch_bytes(costs, start=a, stop=b) if prefetch else 0

    def fits(a: int, b: int, prev: tuple[int, int] | None) -> bool:
        need = ws(a, b) + max(pf(*prev) if prev else 0, pf(b, b + 1) if b < n else 0)
        if need > budget:
            return False
        if prev is not None and ws(*prev) + pf(a, b) > budget:
            return False
        return b >= n or ws(b, b + 1) + pf(a, b) <= budget

    cuts: list[int] = []
    prev: tuple[int, int] | None = None
    a = 0
    while a < n:
        b = a + 1
        while b < n and fits(a, b + 1, prev):
            b += 1
        if b < n:
            cuts.append(b)
        prev = (a, b)
        a = b
    return cuts
