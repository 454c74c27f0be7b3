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
  rounded up) and the corpus as int64 token ids.
"""

from __future__ import annotations

from typing import Any

from jobrules.data import data_vocab_size
from jobrules.parallel import world_size
from jobrules.sizing import FP32, INT64, layer_activation_bytes, layer_param_counts, state_bytes_per_param

RANK_RUNTIME_BYTES = 384 * 2**20


def host_memory_bytes(spec: dict[str, Any]) -> dict[str, int]:
    """{'model_state', 'activations', 'runtime', 'total'} in bytes for a validated JobSpec dict."""
    model, train, par = spec["model"], spec["train"], spec.get("parallel") or {}
    keys = ("kind", "layers", "d_model", "heads", "seq_len", "mlp_ratio")
    shape = {k: model[k] for k in keys if k in model}
    vocab = model.get("vocab_size") or data_vocab_size(spec.get("data") or {})
    try:
        if vocab is None:  # only the data files on the worker tell it
            raise ValueError("vocabulary unknown")
        params = sum(layer_param_counts(**shape, vocab_size=vocab))
        activations = sum(layer_activation_bytes(batch_size=train["batch_size"], vocab_size=vocab, **shape))
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
    corpus = INT64 * ((spec.get("data") or {}).get("max_chars") or 0)
    runtime = ranks * (RANK_RUNTIME_BYTES + corpus)
    return {
        "model_state": model_state,
        "activations": activations,
        "runtime": runtime,
        "total": model_state + activations + runtime,
    }
