"""Cross-field rules of a JobSpec that no single field can check, so the API refuses a job that can
never run. The memory rule is jobrules/sizing.py, the same code the trainer's partitioner is tested
against (equal byte for byte for fp32 jobs)."""

from __future__ import annotations

from typing import Any

from jobrules.data import data_vocab_size
from jobrules.parallel import parallel_problems
from jobrules.sizing import layer_param_counts, layer_working_sets

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
    vocab = model.get("vocab_size") or data_vocab_size(spec.get("data", {}))

    # world size, schedules, tensor layouts, divisibility and combinations: one function, the
    # trainer's own (trainer/config.py calls it too)
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
