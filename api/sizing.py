"""Pure-Python sizes and cross-field rules of a JobSpec, so the API can refuse a job that can never
run without importing torch. Parameter counts follow trainer/models.py exactly (a test compares
them with the real modules)."""

from __future__ import annotations

from typing import Any

MiB = 2**20


def layer_params(model: dict[str, Any]) -> list[int]:
    """Parameters of each layer of the model's nn.Sequential, in order."""
    D, V, T, r, L = (
        model["d_model"],
        model.get("vocab_size", 128),
        model["seq_len"],
        model["mlp_ratio"],
        model["layers"],
    )
    head = 2 * D + D * V  # layer norm + bias-free projection to the vocabulary
    if model["kind"] == "gpt":
        embed = V * D + T * D
        # ln1 + qkv + attention proj + ln2 + fc + mlp proj
        block = 2 * D + (3 * D * D + 3 * D) + (D * D + D) + 2 * D + (D * r * D + r * D) + (r * D * D + D)
        return [embed, *([block] * L), head]
    embed = V * D
    residual = 2 * D + (D * r * D + r * D) + (r * D * D + D)
    return [embed, *([residual] * L), head]


def activation_bytes(model: dict[str, Any], *, micro_batch: int) -> int:
    """fp32 boundary activation of one layer for one micro-batch (B x T x D), the part of the
    working set that does not depend on the layer's parameters."""
    return 4 * micro_batch * model["seq_len"] * model["d_model"]


def layer_working_set_bytes(model: dict[str, Any], *, micro_batch: int, offload: bool) -> list[int]:
    """What one resident layer needs on the device: fp32 params + grads + Adam moments (16 B/param),
    or with the offloaded optimizer low-precision params + grads (4 B/param), plus the layer's
    boundary input and output activations."""
    per_param = 4 if offload else 16
    act = 2 * activation_bytes(model, micro_batch=micro_batch)
    return [per_param * n + act for n in layer_params(model)]


def spec_problems(spec: dict[str, Any]) -> list[str]:
    """Cross-field rules that no single field can check; each message names the fields."""
    problems: list[str] = []
    model, train, par = spec["model"], spec["train"], spec["parallel"]
    n_layers = model["layers"] + 2  # embedding and head are layers too
    pipe, tensor, spill, offload = (
        par.get("pipeline"),
        par.get("tensor"),
        par.get("spill"),
        par.get("offload"),
    )

    micro_batch = train["batch_size"]
    if pipe and pipe["stages"] > 1:
        if pipe["stages"] > n_layers:
            problems.append(
                f"parallel.pipeline.stages ({pipe['stages']}) must be <= the model's layers "
                f"({model['layers']} blocks + embedding + head = {n_layers})"
            )
        if train["batch_size"] % pipe["microbatches"]:
            problems.append(
                f"parallel.pipeline.microbatches ({pipe['microbatches']}) must divide "
                f"train.batch_size ({train['batch_size']})"
            )
        micro_batch = max(1, train["batch_size"] // pipe["microbatches"])

    if tensor:
        mode = tensor["mode"]
        split = {"1d": tensor["size"], "2d": tensor["q"], "2.5d": tensor["q"]}[mode]
        ffn = model["mlp_ratio"] * model["d_model"]
        if model["kind"] != "gpt" and split > 1:
            problems.append("parallel.tensor needs model.kind 'gpt'")
        if model["d_model"] % split:
            problems.append(
                f"model.d_model ({model['d_model']}) must be divisible by the {mode} split ({split})"
            )
        if model["heads"] % split:
            problems.append(f"model.heads ({model['heads']}) must be divisible by the {mode} split ({split})")
        if ffn % split:
            problems.append(
                f"model.mlp_ratio*d_model ({ffn}) must be divisible by the {mode} split ({split})"
            )
        if model.get("vocab_size", 128) % split:
            problems.append(f"model.vocab_size (128) must be divisible by the {mode} split ({split})")
        rows = {"1d": 1, "2d": tensor["q"], "2.5d": tensor["q"] * tensor["d"]}[mode]
        if micro_batch % rows:
            what = "train.batch_size" if not (pipe and pipe["stages"] > 1) else "the micro-batch size"
            problems.append(
                f"{what} ({micro_batch}) must be divisible by {'q' if mode == '2d' else 'd*q'} ({rows}) for {mode}"
            )

    if spill:
        budget = spill["device_budget_mb"] * MiB
        use_offload = bool(offload and offload.get("optimizer"))
        sets = layer_working_set_bytes(model, micro_batch=micro_batch, offload=use_offload)
        biggest = max(range(len(sets)), key=sets.__getitem__)
        if sets[biggest] > budget:
            problems.append(
                f"parallel.spill.device_budget_mb ({spill['device_budget_mb']:g}) is smaller than the "
                f"largest single layer's working set (layer {biggest}: {sets[biggest] / MiB:.2f} MiB = "
                f"{layer_params(model)[biggest]:,} params x {4 if use_offload else 16} B + activations); "
                f"raise the budget or shrink model.d_model"
            )
        cuts = spill.get("cuts")
        if cuts is not None and (cuts != sorted(set(cuts)) or any(not 0 < c < n_layers for c in cuts)):
            problems.append(
                f"parallel.spill.cuts ({cuts}) must be strictly increasing layer indices in [1, {n_layers - 1}]"
            )
    return problems
