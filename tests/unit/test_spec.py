"""JobSpec validation on the API's side (pydantic) and on the trainer's (trainer/config.py load_job, with the trainer's own checks) agree."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from pydantic import ValidationError

from api.schemas import JobSpec
from jobrules.spec import SpecError
from trainer.config import load_job

GOOD = [
    {},
    json.loads((Path(__file__).resolve().parents[2] / "api" / "demo_spec.json").read_text()),
    {"model": {"kind": "mlp", "layers": 2, "d_model": 64}},
    {
        "parallel": {"pipeline": {"stages": 4, "microbatches": 8, "schedule": "chimera"}},
        "train": {"batch_size": 16},
    },
    {"parallel": {"tensor": {"mode": "2.5d", "q": 2, "d": 2}}, "train": {"batch_size": 16}},
    # pipelines run on NCCL: their messages are untagged and ordered (trainer/pipeline/checker.py)
    {
        "parallel": {"pipeline": {"stages": 2, "microbatches": 2, "schedule": "chimera-zb"}},
        "resources": {"device": "cuda", "gpus": 2},
    },
    {"parallel": {"tensor": {"mode": "1d", "size": 4}}},
    {"parallel": {"spill": {"device_budget_mb": 64, "prefetch": False}, "offload": {"optimizer": True}}},
]


@pytest.mark.parametrize("raw", GOOD)
def test_good_specs_pass_both_checks(raw: dict) -> None:
    spec = JobSpec.model_validate(raw)
    cfg = load_job(spec.model_dump())
    assert cfg.parallel.world_size == spec.parallel.world_size


def test_world_size_and_queue() -> None:
    spec = JobSpec.model_validate({"parallel": {"tensor": {"mode": "2.5d", "q": 2, "d": 2}}})
    assert spec.parallel.world_size == 8
    assert spec.queue == "cpu"
    assert JobSpec.model_validate({"resources": {"gpus": 1}}).queue == "gpu"


@pytest.mark.parametrize(
    ("raw", "needle"),
    [
        ({"model": {"d_model": 30, "heads": 4}}, "model.d_model (30) must be divisible by model.heads (4)"),
        ({"parallel": {"pipeline": {"stages": 2, "microbatches": 5}}}, "microbatches (5) must divide"),
        ({"train": {"nonsense": 1}}, "nonsense"),
    ],
)
def test_bad_specs_fail_both_checks_naming_the_field(raw: dict, needle: str) -> None:
    with pytest.raises(ValidationError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        JobSpec.model_validate(raw)
    with pytest.raises(SpecError):
        load_job(raw)
