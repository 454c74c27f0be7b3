"""The JobSpec's `model` section rules, stated once for the API and the trainer (stdlib only)."""

from __future__ import annotations

from typing import Any, Literal, get_args

from jobrules.data import ENTRY_HINT, is_entry

ModelKind = Literal["gpt", "mlp", "llama", "python"]
"""The model kinds, named once: the request model's `model.kind` and MODEL_KINDS are this."""
MODEL_KINDS: tuple[ModelKind, ...] = get_args(ModelKind)
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


TENSOR_KINDS = {"gpt": ("1d", "2d", "2.5d"), "llama": ("1d",)}
"""Model kinds with tensor-parallel layers, and the modes each has."""


def swiglu_width(d_model: int, mlp_ratio: int) -> int:
    """The Llama recipe's SwiGLU width: 2/3 of the dense MLP's, rounded up to 8."""
    return -(-2 * mlp_ratio * d_model // 3 // 8) * 8


def tensor_kind_problems(model: dict[str, Any], *, mode: str, split: int) -> list[str]:
    """Whether `model.kind` has a tensor-parallel form in `mode`, and the Llama-only divisibility
    rules (key/value heads, SwiGLU width); GPT's rules are trainer/tensor/grid.py's."""
    kind = model.get("kind", "gpt")
    modes = TENSOR_KINDS.get(kind, ())
    if mode not in modes:
        if not modes:
            return [
                f"parallel.tensor: model.kind is {kind!r}, which has no tensor-parallel layers (gpt and llama do)"
            ]
        return [
            f"parallel.tensor.mode {mode} has no form for model.kind {kind} (RMSNorm, SwiGLU and "
            f"grouped-query attention are sharded 1d only): use mode {' or '.join(modes)}"
        ]
    problems = []
    if kind == "llama":
        kv = model.get("kv_heads") or model.get("heads", 4)
        if kv % split:
            problems.append(
                f"model.kv_heads ({kv}) must be divisible by parallel.tensor.size ({split}) for 1d"
            )
        width = swiglu_width(model.get("d_model", 128), model.get("mlp_ratio", 4))
        if width % split:
            problems.append(
                f"the SwiGLU width ({width}) must be divisible by parallel.tensor.size ({split}) for 1d"
            )
    return problems
