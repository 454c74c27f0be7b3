"""Search-space expansion: dotted paths, grid and random, and the errors a bad space gets."""

from __future__ import annotations

import ast
import math
import subprocess
import sys
from pathlib import Path

import pytest

from jobrules.spec import OffloadSpec, PipelineSpec, SpillSpec, TensorSpec
from trainer.config import load_job
from trainer.selection.space import KNOWN_PATHS, SpaceError, apply_params, expand, sample_params

BASE = {"name": "b", "model": {"kind": "mlp", "layers": 2, "d_model": 16}, "train": {"steps": 5, "lr": 1e-3}}


def test_space_module_imports_only_the_standard_library_and_the_request_models() -> None:
    # the implementation is jobrules/space.py, shared with the REST layer
    src = Path("jobrules/space.py").read_text()
    roots = set()
    for node in ast.walk(ast.parse(src)):
        if isinstance(node, ast.Import):
            roots |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            roots.add(node.module.split(".")[0])
    assert roots <= set(sys.stdlib_module_names) | {"jobrules"}, roots - set(sys.stdlib_module_names)
    # and importing it through its package pulls in no torch (the REST layer has none)
    code = "import sys, trainer.selection.space; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_known_paths_are_the_jobspecs_own_fields() -> None:
    """The table is read off the JobSpec (jobrules/spec.py): every leaf of every section, the
    environment excepted, and a path that is no field is not in it."""
    spec = load_job({}).to_dict()
    spec["parallel"] |= {  # the sections a default spec leaves out
        "spill": SpillSpec(device_budget_mb=1.0).model_dump(),
        "offload": OffloadSpec().model_dump(),
        "pipeline": PipelineSpec().model_dump(),
        "tensor": TensorSpec().model_dump(),
    }
    leaves = set()

    def walk(node: dict, prefix: str) -> None:
        for k, v in node.items():
            if k in ("env", "workspace"):
                continue
            if isinstance(v, dict) and k != "args":
                walk(v, f"{prefix}{k}.")
            else:
                leaves.add(prefix + k)

    walk(spec, "")
    assert leaves == set(KNOWN_PATHS)
    assert "env.pip" not in KNOWN_PATHS and "workspace" not in KNOWN_PATHS and "max_restarts" in KNOWN_PATHS


def test_grid_is_the_cartesian_product_in_key_order() -> None:
    plans = expand(base=BASE, space={"train.lr": [1e-3, 1e-2], "model.layers": [2, 4, 8]}, method="grid")
    assert [p.params for p in plans] == [
        {"train.lr": lr, "model.layers": n} for lr in (1e-3, 1e-2) for n in (2, 4, 8)
    ]
    assert [p.index for p in plans] == list(range(6))
    assert plans[4].spec["model"] == {"kind": "mlp", "layers": 4, "d_model": 16}
    assert plans[4].spec["train"] == {"steps": 5, "lr": 1e-2}
    assert BASE["model"]["layers"] == 2  # the base is not modified
    for p in plans:
        load_job(p.spec)  # every trial spec is a valid JobSpec


def test_grid_over_a_range_needs_num_and_spaces_points() -> None:
    with pytest.raises(SpaceError, match="num"):
        sample_params({"train.lr": {"low": 1e-4, "high": 1e-2}}, method="grid")
    got = sample_params({"train.lr": {"low": 1e-4, "high": 1e-2, "log": True, "num": 3}}, method="grid")
    assert [g["train.lr"] for g in got] == pytest.approx([1e-4, 1e-3, 1e-2])
    got = sample_params({"model.layers": {"low": 2, "high": 4, "num": 5}}, method="grid")
    assert [g["model.layers"] for g in got] == [2, 3, 4]  # ints, repeats dropped


def test_random_is_seeded_in_range_and_log_uniform() -> None:
    space = {"train.lr": {"low": 1e-4, "high": 3e-3, "log": True}, "model.layers": [4, 8, 12]}
    a = sample_params(space, method="random", trials=400, seed=3)
    assert a == sample_params(space, method="random", trials=400, seed=3)
    assert a != sample_params(space, method="random", trials=400, seed=4)
    lrs = [p["train.lr"] for p in a]
    assert all(1e-4 <= v <= 3e-3 for v in lrs)
    assert {p["model.layers"] for p in a} == {4, 8, 12}
    # log-uniform: about half the draws fall below the geometric midpoint
    mid = math.sqrt(1e-4 * 3e-3)
    assert 0.4 < sum(v < mid for v in lrs) / len(lrs) < 0.6
    ints = sample_params({"model.layers": {"low": 2, "high": 6}}, method="random", trials=50, seed=0)
    assert all(isinstance(p["model.layers"], int) and 2 <= p["model.layers"] <= 6 for p in ints)


def test_missing_sections_are_created() -> None:
    spec = apply_params({"model": {"kind": "gpt"}}, {"parallel.spill.device_budget_mb": 64})
    assert spec["parallel"] == {"spill": {"device_budget_mb": 64}}


@pytest.mark.parametrize(
    ("space", "kwargs", "message"),
    [
        ({"train.lrr": [1]}, {"method": "grid"}, r"'train.lrr' is not a JobSpec field.*train.lr"),
        ({"model.layers": []}, {"method": "grid"}, r"'model.layers'.* empty list"),
        ({"train.lr": {"low": 3e-3, "high": 1e-4}}, {"method": "random", "trials": 2}, r"low \(0.003\)"),
        ({"train.lr": {"low": 1e-3, "high": 1e-3}}, {"method": "random", "trials": 2}, r"must be < high"),
        ({"train.lr": {"low": 0, "high": 1, "log": True}}, {"method": "random", "trials": 2}, "low > 0"),
        ({"train.lr": {"high": 1}}, {"method": "random", "trials": 2}, "both low and high"),
        ({"train.lr": 0.1}, {"method": "grid"}, "must be a list of values or a range"),
        ({"train.lr": [1]}, {"method": "random"}, "trials >= 1"),
        ({"train.lr": [1]}, {"method": "grid", "trials": 3}, "grid takes no trials"),
        ({"train.lr": [1]}, {"method": "bayes"}, "grid or random"),
        ({}, {"method": "grid"}, "non-empty"),
        ({"train.lr": {"low": 0.0, "high": 1.0, "num": 2000}}, {"method": "grid"}, "more than the limit"),
    ],
)
def test_bad_spaces_name_the_problem(space: dict, kwargs: dict, message: str) -> None:
    with pytest.raises(SpaceError, match=message):
        sample_params(space, **kwargs)


def test_setting_inside_a_non_object_is_refused() -> None:
    with pytest.raises(SpaceError, match="base spec's parallel.spill is 3"):
        apply_params({"parallel": {"spill": 3}}, {"parallel.spill.prefetch": True})
