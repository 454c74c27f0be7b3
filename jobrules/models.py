"""The JobSpec's `model` section rules, stated once for the API and the trainer (stdlib only)."""

from __future__ import annotations

from typing import Any

from jobrules.data import ENTRY_HINT, is_entry

MODEL_KINDS = ("gpt", "mlp", "llama", "python")
BUILTIN = ("gpt", "mlp", "llama")


def model_problems(model: dict[str, Any]) -> list[str]:
    """Every broken rule of one `model` section; each message names the field and the numbers."""
    kind = model.get("kind", "gpt")
    if kind not in MODEL_KINDS:
        return [f"model.kind must be one of {', '.join(MODEL_KINDS)}, got {kind!r}"]
    problems: list[str] = []

    def bounded(name: str, lo: int, hi: int, default: int) -> int:
        v = model.get(name, default)
        if not isinstance(v, int) or not lo <= v <= hi:
            problems.append(f"model.{name} must be an integer in [{lo}, {hi}], got {v!r}")
            return default
        return v

    layers = bounded("layers", 1, 256, 4)
    d_model = bounded("d_model", 8, 16384, 128)
    heads = bounded("heads", 1, 256, 4)
    bounded("seq_len", 1, 8192, 64)
    bounded("mlp_ratio", 1, 16, 4)
    del layers
    vocab = model.get("vocab_size")
    if vocab is not None and (not isinstance(vocab, int) or not 2 <= vocab <= 2**24):
        problems.append(f"model.vocab_size must be an integer in [2, 16777216] or left out, got {vocab!r}")
    if kind in ("gpt", "llama") and d_model % heads:
        problems.append(f"model.d_model ({d_model}) must be divisible by model.heads ({heads})")
    kv = model.get("kv_heads")
    if kv is not None:
        if kind != "llama":
            problems.append(f"model.kv_heads is only for model.kind llama, not {kind}")
        elif not isinstance(kv, int) or kv < 1 or heads % kv:
            problems.append(f"model.kv_heads ({kv}) must be >= 1 and divide model.heads ({heads})")
    if kind == "llama" and (d_model // max(heads, 1)) % 2:
        problems.append(
            f"model.d_model / model.heads ({d_model // max(heads, 1)}) must be even for llama "
            f"(rotary embeddings rotate pairs of dims)"
        )
    entry = model.get("entry")
    if kind == "python":
        if not is_entry(entry):
            problems.append(f"model.entry must be {ENTRY_HINT} for model.kind python, got {entry!r}")
    else:
        if entry is not None:
            problems.append(f"model.entry is only for model.kind python, not {kind}")
        if model.get("args"):
            problems.append(f"model.args is only for model.kind python, not {kind}")
    init = model.get("init_from")
    if init is not None:
        if not isinstance(init, str) or not init.endswith((".safetensors", ".pt", ".pth", ".bin")):
            problems.append(f"model.init_from must be a .safetensors, .pt, .pth or .bin file, got {init!r}")
    return problems
