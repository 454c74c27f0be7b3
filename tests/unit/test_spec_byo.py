"""The model/data rules at submit (api/schemas.py with jobrules/data.py and jobrules/models.py)
and in the trainer's own config (trainer/config.py): each refusal names the field and the rule."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from api.schemas import JobSpec
from jobrules.spec import SpecError
from trainer.config import load_job

WS = "sha256:" + "ab" * 32


def refusal(spec: dict[str, Any]) -> str:
    with pytest.raises(ValidationError) as e:
        JobSpec.model_validate(spec)
    return str(e.value)


@pytest.mark.parametrize(
    ("spec", "reason"),
    [
        (
            {"data": {"tokenizer": "byte"}, "model": {"vocab_size": 128}},
            r"vocabulary \(256\) is larger than model.vocab_size \(128\)",
        ),
        (
            {"data": {"kind": "tokens", "path": "/d", "vocab_size": 5000}, "model": {"vocab_size": 4096}},
            r"vocabulary \(5000\)",
        ),
        ({"data": {"path": "corpus.txt"}}, r"data.path \('corpus.txt'\) is relative"),
        ({"data": {"path": "/c.txt", "tokenizer": "tok.json"}}, r"data.tokenizer \('tok.json'\) is relative"),
        ({"model": {"kind": "python", "entry": "a.b:c"}}, "model.kind python needs a workspace"),
        (
            {"model": {"kind": "python", "entry": "not an entry"}, "workspace": WS},
            "model.entry must be 'package.module:function'",
        ),
        ({"data": {"kind": "python", "entry": "a:b"}}, "data.kind python needs a workspace"),
        ({"data": {"kind": "tokens"}}, "data.path is required for data.kind tokens"),
        ({"data": {"corpus": "stdlib", "path": "/x"}}, "data.corpus and data.path are exclusive"),
        (
            {"data": {"tokenizer": "gpt2"}},
            "data.tokenizer must be char, byte or the path of a tokenizers .json",
        ),
        ({"data": {"kind": "tokens", "path": "/d", "vocab_size": 70000}}, "does not fit data.dtype uint16"),
        ({"model": {"kind": "gpt", "kv_heads": 2}}, "model.kv_heads is only for model.kind llama"),
        (
            {"model": {"kind": "llama", "heads": 4, "kv_heads": 3}},
            r"model.kv_heads \(3\) must be >= 1 and divide model.heads \(4\)",
        ),
        ({"model": {"kind": "llama", "d_model": 36, "heads": 4}}, "must be even for llama"),
        ({"model": {"kind": "llama", "init_from": "w.txt"}}, "model.init_from must be a .safetensors"),
        (
            {
                "model": {"kind": "llama", "heads": 4},
                "parallel": {"tensor": {"mode": "2d", "q": 2}},
                "train": {"batch_size": 4},
            },
            "mode 2d has no form for model.kind llama",
        ),
        (
            {
                "model": {"kind": "llama", "heads": 4, "kv_heads": 1},
                "parallel": {"tensor": {"mode": "1d", "size": 2}},
            },
            r"model.kv_heads \(1\) must be divisible by parallel.tensor.size \(2\)",
        ),
        ({"workspace": "../etc"}, "workspace"),
    ],
)
def test_submit_refuses_with_the_reason(spec: dict[str, Any], reason: str) -> None:
    import re

    assert re.search(reason, refusal(spec)), refusal(spec)


@pytest.mark.parametrize(
    "spec",
    [
        {"data": {"tokenizer": "byte"}},
        {"data": {"path": "corpus.txt", "tokenizer": "tokenizer.json"}, "workspace": "12"},
        {"model": {"kind": "python", "entry": "pkg.mod:make", "args": {"width": 8}}, "workspace": WS},
        {
            "model": {"kind": "llama", "heads": 4, "kv_heads": 2},
            "parallel": {"tensor": {"mode": "1d", "size": 2}},
        },
        {"data": {"kind": "tokens", "path": "/data/owt", "dtype": "uint32", "vocab_size": 100_000}},
    ],
)
def test_valid_specs_pass_both_sides(spec: dict[str, Any]) -> None:
    dumped = JobSpec.model_validate(spec).model_dump()
    load_job(dumped)


def test_the_trainer_states_the_same_rules() -> None:
    with pytest.raises(SpecError, match=r"vocabulary \(256\) is larger than model.vocab_size \(128\)"):
        load_job({"data": {"tokenizer": "byte"}, "model": {"vocab_size": 128}})
    with pytest.raises(SpecError, match="data.entry must be 'package.module:function'"):
        load_job({"data": {"kind": "python", "entry": "nope"}})
