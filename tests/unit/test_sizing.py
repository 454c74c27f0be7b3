"""api/sizing.py computes parameter counts without torch; they must equal the real modules'."""

from __future__ import annotations

import pytest

from api.sizing import layer_params
from trainer.config import ModelConfig
from trainer.models import build_model


@pytest.mark.parametrize(
    "model",
    [
        {"kind": "gpt", "layers": 3, "d_model": 48, "heads": 4, "seq_len": 40, "mlp_ratio": 4},
        {"kind": "gpt", "layers": 1, "d_model": 16, "heads": 2, "seq_len": 8, "mlp_ratio": 2},
        {"kind": "mlp", "layers": 2, "d_model": 32, "heads": 1, "seq_len": 16, "mlp_ratio": 3},
    ],
)
def test_layer_params_match_the_modules(model: dict) -> None:
    real = build_model(ModelConfig(**model), seed=0)
    assert layer_params(model) == [sum(p.numel() for p in layer.parameters()) for layer in real]
