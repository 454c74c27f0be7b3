"""The JobSpec's `data` section rules and the model/data vocabulary rule, stated once for the API
and the trainer (both through jobrules/spec.py). Stdlib only: no file is read here, so only
what the spec itself says is checked; paths are checked by the trainer on the worker."""

from __future__ import annotations

from typing import Any

CHAR_VOCAB = 128
BYTE_VOCAB = 256
BUILTIN_TOKENIZERS = {"char": CHAR_VOCAB, "byte": BYTE_VOCAB}
ENTRY_HINT = "'package.module:function'"


def is_entry(spec: object) -> bool:
    if not isinstance(spec, str):
        return False
    module, sep, attr = spec.partition(":")
    names = [*module.split("."), *attr.split(".")]
    return bool(sep) and all(n.isidentifier() for n in names)


def data_problems(data: dict[str, Any]) -> list[str]:
    """Every broken rule of one `data` section; each message names the field."""
    kind = data.get("kind", "text")
    path, corpus, entry = data.get("path"), data.get("corpus"), data.get("entry")
    problems: list[str] = []
    if kind not in ("text", "tokens", "python"):
        return [f"data.kind must be text, tokens or python, got {kind!r}"]
    if kind == "text":
        if path is not None and corpus is not None:
            problems.append("data.corpus and data.path are exclusive: give one (no path means corpus stdlib)")
        if corpus not in (None, "stdlib"):
            problems.append(f"data.corpus must be 'stdlib', got {corpus!r}")
        tok = data.get("tokenizer", "char")
        if not isinstance(tok, str) or not tok:
            problems.append("data.tokenizer must be char, byte or the path of a tokenizers JSON file")
        elif tok not in BUILTIN_TOKENIZERS and not tok.endswith(".json"):
            problems.append(
                f"data.tokenizer must be char, byte or the path of a tokenizers .json file, got {tok!r}"
            )
        if data.get("max_chars", 4_000_000) < 10_000:
            problems.append(f"data.max_chars must be >= 10000, got {data['max_chars']}")
        vf = data.get("val_fraction", 0.1)
        if not 0.0 < vf < 0.5:
            problems.append(f"data.val_fraction must be in (0, 0.5), got {vf}")
    else:
        if corpus is not None:
            problems.append(f"data.corpus is for data.kind text, not {kind}")
    if kind == "tokens" and not path:
        problems.append("data.path is required for data.kind tokens (the folder with train.bin and val.bin)")
    if kind == "python":
        if not is_entry(entry):
            problems.append(f"data.entry must be {ENTRY_HINT} for data.kind python, got {entry!r}")
        if path is not None:
            problems.append("data.path is not used by data.kind python (pass it in data.args)")
    elif entry is not None:
        problems.append(f"data.entry is only for data.kind python, not {kind}")
    if data.get("args") and kind != "python":
        problems.append(f"data.args is only for data.kind python, not {kind}")
    vocab = data.get("vocab_size")
    if vocab is not None:
        if kind == "text":
            problems.append("data.vocab_size is set by data.tokenizer for data.kind text; leave it out")
        elif not isinstance(vocab, int) or not 2 <= vocab <= 2**32:
            problems.append(f"data.vocab_size must be an integer in [2, 2^32], got {vocab!r}")
        elif data.get("dtype", "uint16") == "uint16" and kind == "tokens" and vocab > 2**16:
            problems.append(f"data.vocab_size ({vocab}) does not fit data.dtype uint16 (<= 65536)")
    return problems


def data_vocab_size(data: dict[str, Any]) -> int | None:
    """The data's vocabulary when the spec alone tells it; None when only the files can."""
    if data.get("kind", "text") == "text":
        return BUILTIN_TOKENIZERS.get(data.get("tokenizer", "char"))
    return data.get("vocab_size")


def spec_vocab_size(spec: dict[str, Any]) -> int | None:
    """The vocabulary a JobSpec dict's model embeds: model.vocab_size, else the data's when the spec
    alone tells it (data_vocab_size); None when only the data files on the worker can."""
    return (spec.get("model") or {}).get("vocab_size") or data_vocab_size(spec.get("data") or {})


def vocab_problem(*, model_vocab: int | None, data_vocab: int | None) -> str | None:
    """The model must embed every token id the data holds."""
    if model_vocab is not None and data_vocab is not None and data_vocab > model_vocab:
        return (
            f"the data's vocabulary ({data_vocab}) is larger than model.vocab_size ({model_vocab}); "
            f"leave model.vocab_size out to follow the data, or raise it"
        )
    return None


def _relative(value: object) -> bool:
    return isinstance(value, str) and value not in BUILTIN_TOKENIZERS and not value.startswith(("/", "~"))


def workspace_problems(*, model: dict[str, Any], data: dict[str, Any], has_workspace: bool) -> list[str]:
    """Parts of a spec that need an uploaded workspace: user code, and relative paths (which
    resolve inside the workspace on the worker)."""
    if has_workspace:
        return []
    problems = [
        f"{section}.{name} ({value!r}) is relative: give an absolute path on the workers, or a workspace"
        for section, name, value in (
            ("data", "path", data.get("path")),
            ("data", "tokenizer", data.get("tokenizer") if data.get("kind", "text") == "text" else None),
            ("model", "init_from", model.get("init_from")),
        )
        if _relative(value)
    ]
    for section, part in (("model", model), ("data", data)):
        if part.get("kind") == "python":
            problems.append(f"{section}.kind python needs a workspace (the code of {section}.entry)")
    return problems
