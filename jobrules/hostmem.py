"""How much host memory a job needs on the worker that runs it, from its spec alone (no torch).

The API refuses a job whose estimate exceeds the largest worker's RAM, and the worker runs the
trainer under a limit derived from the same estimate, so a job that outgrows it fails itself
("out of host memory") instead of taking the worker down.

The estimate, all ranks of the job together (they run on one worker):
- model state: every parameter in fp32 with its gradient and optimizer state (jobrules/sizing.py's
  bytes per parameter), once per model replica (Chimera keeps two). Spilling and offload move
  state between the device and host memory but the host still holds all of it.
- activations: what autograd saves for the whole batch (an upper bound for pipelines, which hold
  only the micro-batches in flight).
- per rank: the Python + torch runtime (about 280 MiB measured after `import torch` on CPU,
  rounded up) and a text corpus's token ids (1 byte each for the char and byte tokenizers, 4 for a
  tokenizer file; `tokens` data is memory-mapped and `python` data is the user's, so 0).
"""

from __future__ import annotations

from typing import Any

from jobrules.data import BUILTIN_TOKENIZERS, spec_vocab_size
from jobrules.parallel import world_size
from jobrules.sizing import FP32, layer_activation_bytes, layer_param_counts, state_bytes_per_param

__all__ = ["RANK_RUNTIME_BYTES", "host_memory_bytes", "world_size"]

RANK_RUNTIME_BYTES = 384 * 2**20


def host_memory_bytes(spec: dict[str, Any]) -> dict[str, int]:
    """{'model_state', 'activations', 'runtime', 'total'} in bytes for a validated JobSpec dict."""
    model, train, par = spec["model"], spec["train"], spec.get("parallel") or {}
    data = spec.get("data") or {}
    keys = ("kind", "layers", "d_model", "heads", "seq_len", "mlp_ratio")
    shape = {k: model[k] for k in keys if k in model}
    # the vocabulary follows the data when the spec leaves it out; unknown until the worker reads
    # the files (a tokenizer file, tokens without vocab_size): count the model's other layers only
    shape["vocab_size"] = spec_vocab_size(spec) or 0
    try:
        params = sum(layer_param_counts(**shape))
        activations = sum(layer_activation_bytes(batch_size=train["batch_size"], **shape))
    except ValueError:  # a model sizing.py cannot size from the spec (llama, python): runtime only
        params = activations = 0
    pipe = par.get("pipeline")
    replicas = 2 if pipe and str(pipe.get("schedule", "")).startswith("chimera") else 1
    replicas *= par.get("data_parallel", 1)
    per_param = 2 * FP32 + state_bytes_per_param(
        optimizer=train["optimizer"], momentum=train.get("momentum", 0.0)
    )
    model_state = replicas * params * per_param
    ranks = world_size(par)
    corpus = 0
    if data.get("kind", "text") == "text":
        per_id = 1 if data.get("tokenizer", "char") in BUILTIN_TOKENIZERS else FP32
        corpus = per_id * (data.get("max_chars") or 0)
    runtime = ranks * (RANK_RUNTIME_BYTES + corpus)
    return {
        "model_state": model_state,
        "activations": activations,
        "runtime": runtime,
        "total": model_state + activations + runtime,
    }
