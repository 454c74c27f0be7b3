"""Pure-Python sizes of the registry models (no torch import): for the REST layer's submit check
"the spill budget must hold the largest single layer's working set" (docs/memory.md).

Layers are those of trainer/models.py, in order: gpt = [Embedding, Block x L, Head], mlp =
[CharInput, Residual x L, Head]. D d_model, F = mlp_ratio * D, V vocab, T seq_len, H heads,
N = batch_size * T tokens of one micro-batch (the spilling engine's micro-batch is the whole batch).

A layer's working set is the partitioner's W(s) for a one-layer shard (trainer/spill/partition.py):
params + grads + optimizer state (bytes/param: 4+4+8 = 16 for fp32 AdamW, 4+4+4 for SGD with
momentum, 4+4 for plain SGD, 2+2+0 with the offloaded optimizer in bf16/fp16) + the activations
autograd saves for one micro-batch + 2 x the boundary input (device copy and its gradient) + the
boundary output's gradient (not for the last layer) + the offload bucket buffers when offloading.
Activations are counted as the meta-device trial counts them (math attention, fp32), which is also
what the trainer uses on CPU, so for fp32 jobs the numbers are identical; for bf16/fp16 and for
CUDA (measured, fused attention) the trainer's own count is usually smaller. Spill without prefetch
needs budget >= max W(layer); prefetch also needs room for the neighbour (else the trainer turns it off).
On CUDA the trainer also reserves the math libraries' workspaces in the budget (measured on the
worker's GPU, 64 MiB on an H100); this rule cannot know the GPU, so it checks the layers alone and
the trainer refuses, with the numbers, a budget the workspaces do not fit beside them.
"""

from __future__ import annotations

from typing import Any

from jobrules.data import spec_vocab_size
from jobrules.parallel import parallel_problems, spill_state_on_host

INT64 = 8
FP32 = 4


def layer_param_counts(
    *,
    kind: str,
    layers: int,
    d_model: int,
    heads: int,
    seq_len: int,
    vocab_size: int = 128,
    mlp_ratio: int = 4,
) -> list[int]:
    """Exact parameter count of each layer, in model order."""
    D, F, V, T = d_model, mlp_ratio * d_model, vocab_size, seq_len
    head = 2 * D + D * V  # LayerNorm (weight, bias) + bias-free vocabulary projection
    if kind == "gpt":
        embedding = V * D + T * D
        # ln1 2D + qkv 3D^2+3D + proj D^2+D + ln2 2D + fc DF+F + proj FD+D
        block = 4 * D * D + 2 * D * F + 9 * D + F
        return [embedding] + [block] * layers + [head]
    if kind == "mlp":
        # ln 2D + fc DF+F + proj FD+D
        residual = 2 * D * F + 3 * D + F
        return [V * D] + [residual] * layers + [head]
    raise ValueError(f"model.kind must be gpt or mlp, got {kind!r}")


def layer_activation_bytes(
    *,
    kind: str,
    layers: int,
    d_model: int,
    heads: int,
    seq_len: int,
    batch_size: int,
    vocab_size: int = 128,
    mlp_ratio: int = 4,
) -> list[int]:
    """Bytes autograd saves for backward in each layer for one micro-batch (fp32, math attention)."""
    D, F, V, T, H = d_model, mlp_ratio * d_model, vocab_size, seq_len, heads
    N = batch_size * T
    # final LayerNorm (input + mean + rstd), projection input, log-softmax, targets, plus the
    # logits' gradient and the loss scalars the partitioner adds for the last layer
    head = FP32 * N * (2 * D + 2 + 2 * V) + INT64 * N + 2 * FP32
    if kind == "gpt":
        embedding = INT64 * (N + T)  # token ids and position ids
        # 2 LayerNorms (D+2 each), qkv input D, q/k/v 3D, attention probabilities H*T, attention
        # output D, proj input D, fc input D, GELU input F, proj input F (per token)
        block = FP32 * N * (8 * D + 2 * F + H * T + 4)
        return [embedding] + [block] * layers + [head]
    if kind == "mlp":
        residual = FP32 * N * (2 * D + 2 * F + 2)
        return [INT64 * N] + [residual] * layers + [head]
    raise ValueError(f"model.kind must be gpt or mlp, got {kind!r}")


def state_bytes_per_param(*, optimizer: str, momentum: float = 0.0, offload: bool = False) -> int:
    if offload:
        return 0
    if optimizer == "adamw":
        return 8
    return 4 if momentum > 0 else 0


def offload_bucket_bytes(total_params: int) -> int:
    """The offloaded optimizer's device bucket buffers (trainer/spill/engine.default_bucket_numel)."""
    bucket_numel = max(1024, min(4 * 2**20, total_params // 128))
    return 2 * 5 * FP32 * bucket_numel


def layer_working_sets(
    *,
    kind: str,
    layers: int,
    d_model: int,
    heads: int,
    seq_len: int,
    batch_size: int,
    optimizer: str = "adamw",
    momentum: float = 0.0,
    offload_dtype: str | None = None,
    vocab_size: int = 128,
    mlp_ratio: int = 4,
    host_state: bool = False,
) -> list[int]:
    """W(layer) in bytes for each layer (see the module docstring). offload_dtype: None when the
    optimizer is not offloaded, else "bf16", "fp16" or "fp32". host_state: the optimizer state
    stays in host memory (`parallel.spill.optimizer: "host"`), so the device holds none of it."""
    shape: dict[str, Any] = {
        "kind": kind,
        "layers": layers,
        "d_model": d_model,
        "heads": heads,
        "seq_len": seq_len,
        "vocab_size": vocab_size,
        "mlp_ratio": mlp_ratio,
    }
    params = layer_param_counts(**shape)
    acts = layer_activation_bytes(batch_size=batch_size, **shape)
    elt = {None: 4, "fp32": 4, "bf16": 2, "fp16": 2}[offload_dtype]
    per_param = 2 * elt + state_bytes_per_param(
        optimizer=optimizer, momentum=momentum, offload=offload_dtype is not None or host_state
    )
    extra = offload_bucket_bytes(sum(params)) if offload_dtype is not None else 0
    N, D, last = batch_size * seq_len, d_model, len(params) - 1
    out = []
    for i, (n, act) in enumerate(zip(params, acts, strict=True)):
        in_bytes = INT64 * N if i == 0 else elt * N * D
        out_grad = 0 if i == last else elt * N * D
        out.append(n * per_param + act + 2 * in_bytes + out_grad + extra)
    return out


def min_spill_budget_mb(**kwargs: object) -> float:
    """The smallest `parallel.spill.device_budget_mb` that can ever run (prefetch off)."""
    return max(layer_working_sets(**kwargs)) / 2**20  # type: ignore[arg-type]


# ---- the JobSpec rules that need the sizes ----------------------------------------------------

MiB = 2**20
SIZED_KINDS = ("gpt", "mlp")
"""Models sized at submit; the others are sized on the worker, on the meta device, before training."""


def _shape(model: dict[str, Any], vocab: int) -> dict[str, Any]:
    shape = {k: model[k] for k in ("kind", "layers", "d_model", "heads", "seq_len", "mlp_ratio")}
    return {**shape, "vocab_size": vocab}


def spec_problems(spec: dict[str, Any]) -> list[str]:
    """Cross-field rules that no single field can check; each message names the fields."""
    problems: list[str] = []
    model, train, par = spec["model"], spec["train"], spec["parallel"]
    n_layers = model["layers"] + 2  # embedding and head are layers too
    spill, offload = par.get("spill"), par.get("offload")
    # None: the vocabulary is only known from the data files on the worker (a tokenizer file,
    # tokens without data.vocab_size), so the rules that need it run in the trainer
    vocab = spec_vocab_size(spec)

    # world size, schedules, tensor layouts, divisibility and combinations: one function, the
    # same rules and words wherever the spec is checked (jobrules/spec.py)
    problems.extend(parallel_problems(spec))
    # spilling runs on one process (parallel_problems refuses it beside any parallel axis), so its
    # micro-batch is the whole batch
    micro_batch = train["batch_size"]
    if spill and model["kind"] in SIZED_KINDS and vocab is not None:
        budget = spill["device_budget_mb"] * MiB
        off = offload.get("dtype", "bf16") if offload and offload.get("optimizer") else None
        # the spilling engine's micro-batch is the whole batch (pipelines bring their own)
        sets = layer_working_sets(
            **_shape(model, vocab),
            batch_size=micro_batch,
            optimizer=train["optimizer"],
            momentum=train.get("momentum", 0.0),
            offload_dtype=off,
            host_state=spill_state_on_host(par),
        )
        biggest = max(range(len(sets)), key=sets.__getitem__)
        if sets[biggest] > budget:
            n = layer_param_counts(**_shape(model, vocab))[biggest]
            problems.append(
                f"parallel.spill.device_budget_mb ({spill['device_budget_mb']:g}) is smaller than the "
                f"largest single layer's working set (layer {biggest}: {n:,} params; "
                f"{sets[biggest] / MiB:.3f} MiB with its gradients, optimizer state and one batch's "
                f"activations); raise it to at least {sets[biggest] / MiB:.3f}"
            )
    if spill:
        cuts = spill.get("cuts")
        if cuts is not None and (cuts != sorted(set(cuts)) or any(not 0 < c < n_layers for c in cuts)):
            problems.append(
                f"parallel.spill.cuts ({cuts}) must be strictly increasing layer indices in [1, {n_layers - 1}]"
            )
    return problems


# ---- a trial's work, for a sampler's logical clock (core/search.py) --------------------------

NOMINAL_VOCAB = 256
"""The vocabulary counted when only the data files know it (a tokenizer file): the same for every
trial of a batch, so it shifts all costs alike."""


def trial_flops(spec: dict[str, Any]) -> float | None:
    """A trial's training work in flops, as the selection executor estimates a trial before it
    has measured one (trainer/selection/shards.py: 8 flops per parameter per token of a step, for
    the forward, the backward and the recompute), plus its evaluations (2 per parameter per token).
    None for a model the registry does not size (its size is known only once it is built)."""
    model, train = spec["model"], spec["train"]
    if model.get("kind") not in SIZED_KINDS:
        return None
    vocab = spec_vocab_size(spec) or NOMINAL_VOCAB
    params = sum(layer_param_counts(**_shape(model, vocab)))
    tokens = train["batch_size"] * model["seq_len"]
    steps = train["steps"]
    evals = steps // train.get("eval_every", steps) * train.get("eval_batches", 1)
    return float(params * tokens * (8 * steps + 2 * evals))
