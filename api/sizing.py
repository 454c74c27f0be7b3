"""Cross-field rules of a JobSpec that no single field can check, so the API refuses a job that can
never run. The memory rule is jobrules/sizing.py, the same code the trainer's partitioner is tested
against (equal byte for byte for fp32 jobs)."""

from __future__ import annotations

from typing import Any

from jobrules.sizing import layer_param_counts, layer_working_sets

MiB = 2**20


def _shape(model: dict[str, Any]) -> dict[str, Any]:
    return {k: model[k] for k in ("kind", "layers", "d_model", "heads", "seq_len", "vocab_size", "mlp_ratio")}


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
    piped = bool(pipe and pipe["stages"] > 1)
    tp = bool(
        tensor
        and {"1d": tensor["size"], "2d": tensor["q"] ** 2, "2.5d": tensor["q"] ** 2 * tensor["d"]}[
            tensor["mode"]
        ]
        > 1
    )
    memory = bool(spill or (offload and offload.get("optimizer")))
    # combinations no engine runs yet are refused here rather than silently ignored by a worker
    if par.get("data_parallel", 1) > 1:
        problems.append("parallel.data_parallel > 1 is not supported yet: use pipeline or tensor parallelism")
    if piped and tp:
        problems.append(
            "parallel.pipeline with parallel.tensor in one job is not supported yet (use one of them)"
        )
    if memory and (piped or tp):
        problems.append(
            "parallel.spill / parallel.offload cannot be combined with pipeline or tensor parallelism yet"
        )
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
        off = offload.get("dtype", "bf16") if offload and offload.get("optimizer") else None
        # the spilling engine's micro-batch is the whole batch (pipelines bring their own)
        sets = layer_working_sets(
            **_shape(model),
            batch_size=micro_batch,
            optimizer=train["optimizer"],
            momentum=train.get("momentum", 0.0),
            offload_dtype=off,
        )
        biggest = max(range(len(sets)), key=sets.__getitem__)
        if sets[biggest] > budget:
            n = layer_param_counts(**_shape(model))[biggest]
            problems.append(
                f"parallel.spill.device_budget_mb ({spill['device_budget_mb']:g}) is smaller than the "
                f"largest single layer's working set (layer {biggest}: {n:,} params; "
                f"{sets[biggest] / MiB:.3f} MiB with its gradients, optimizer state and one batch's "
                f"activations); raise it to at least {sets[biggest] / MiB:.3f}"
            )
        cuts = spill.get("cuts")
        if cuts is not None and (cuts != sorted(set(cuts)) or any(not 0 < c < n_layers for c in cuts)):
            problems.append(
                f"parallel.spill.cuts ({cuts}) must be strictly increasing layer indices in [1, {n_layers - 1}]"
            )
    return problems
