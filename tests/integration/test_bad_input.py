"""Malformed specs are answered 422 with a message naming the field and the rule; nothing is stored."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from tests.conftest import TINY_SPEC, StackHandle

pytestmark = pytest.mark.integration


def with_(path: str, value: Any) -> dict[str, Any]:
    spec = copy.deepcopy(TINY_SPEC)
    node = spec
    *parents, leaf = path.split(".")
    for p in parents:
        node = node.setdefault(p, {})
    node[leaf] = value
    return spec


BAD = [
    (with_("model.layers", 0), "model.layers", "greater than or equal to 1"),
    (with_("model.kind", "rnn"), "model.kind", "'gpt', 'mlp', 'llama' or 'python'"),
    (with_("model.heads", 3), "model.d_model (32) must be divisible by model.heads (3)", None),
    (with_("train.lr", -1), "train.lr", "greater than 0"),
    (with_("train.lr", "fast"), "train.lr", "valid number"),
    (with_("train.optimizer", "adam"), "train.optimizer", "'adamw' or 'sgd'"),
    (with_("train.steps", 0), "train.steps", "greater than or equal to 1"),
    (with_("train.batch_size", 1.5), "train.batch_size", "valid integer"),
    (with_("data.corpus", "wikipedia"), "data.corpus", "'stdlib'"),
    (with_("model.colour", "red"), "model.colour", "Extra inputs are not permitted"),
    (
        with_("parallel.pipeline", {"stages": 3, "microbatches": 4, "schedule": "chimera"}),
        "parallel.pipeline.stages must be even for chimera",
        None,
    ),
    (
        with_("parallel.pipeline", {"stages": 2, "microbatches": 3}),
        "parallel.pipeline.microbatches (3) must divide train.batch_size (8)",
        None,
    ),
    (
        with_("parallel.pipeline", {"stages": 9, "microbatches": 2}),
        "parallel.pipeline.stages (9) must be <=",
        None,
    ),
    (
        with_("parallel.pipeline", {"stages": 2, "microbatches": 2, "schedule": "zigzag"}),
        "parallel.pipeline.schedule",
        None,
    ),
    (
        with_("parallel.tensor", {"mode": "1d", "size": 3}),
        "model.d_model (32) must be divisible by parallel.tensor.size (3) for 1d",
        None,
    ),
    (with_("parallel.tensor", {"mode": "2.5d", "q": 2, "d": 8}), "must be divisible by d*q (16)", None),
    (
        with_("parallel.spill", {"device_budget_mb": 0.01}),
        "parallel.spill.device_budget_mb (0.01) is smaller",
        None,
    ),
    (with_("parallel.spill", {"device_budget_mb": -5}), "parallel.spill.device_budget_mb", "greater than 0"),
    (with_("resources.device", "tpu"), "resources.device", None),
    (
        with_("parallel.data_parallel", 3),
        "train.batch_size (8) must be divisible by parallel.data_parallel (3)",
        None,
    ),
    (
        with_(
            "parallel",
            {
                "pipeline": {"stages": 2, "microbatches": 4},
                "data_parallel": 2,
                "tensor": {"mode": "2d", "q": 2},
            },
        ),
        "the rows of one micro-batch per replica (1) must be divisible by q (2)",
        None,
    ),
    (
        with_("parallel", {"spill": {"device_budget_mb": 64}, "tensor": {"mode": "1d", "size": 2}}),
        "parallel.spill runs on one process only",
        None,
    ),
    (
        with_(
            "parallel",
            {"spill": {"device_budget_mb": 64, "optimizer": "host"}, "offload": {"optimizer": True}},
        ),
        'parallel.spill.optimizer "host" keeps the optimizer state in host memory',
        "choose one",
    ),
    (
        with_("parallel.spill", {"device_budget_mb": 64, "optimizer": "cpu"}),
        "parallel.spill.optimizer",
        "'device' or 'host'",
    ),
    ({"model": "gpt"}, "model", "valid dictionary"),
]


@pytest.mark.parametrize(("spec", "field", "rule"), BAD, ids=[b[1][:40] for b in BAD])
def test_malformed_spec_is_422_naming_the_field(
    stack: StackHandle, spec: dict, field: str, rule: str | None
) -> None:
    before = stack.client.get("/api/jobs").json()["total"]
    resp = stack.client.post("/api/jobs", json=spec)
    assert resp.status_code == 422, resp.text
    detail = resp.json()["detail"]
    assert field in detail, detail
    if rule:
        assert rule in detail, detail
    assert stack.client.get("/api/jobs").json()["total"] == before


def test_body_that_is_not_json_is_422(stack: StackHandle) -> None:
    resp = stack.client.post("/api/jobs", content=b"{not json", headers={"content-type": "application/json"})
    assert resp.status_code == 422
