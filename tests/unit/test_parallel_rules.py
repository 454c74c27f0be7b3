"""jobrules/parallel.py is the one statement of the `parallel` rules: the API's JobSpec (a 422) and
the trainer's load_job / `python -m trainer` (exit 2) refuse the same specs with the same words,
and accept the same combinations with the same world size."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import ValidationError

from api.schemas import JobSpec
from jobrules.parallel import parallel_problems, world_size
from jobrules.spec import SpecError
from trainer.config import load_job

ROOT = Path(__file__).resolve().parents[2]
PIPE = {"stages": 2, "microbatches": 2, "schedule": "1f1b"}


def spec(parallel: dict, **train: object) -> dict:
    return {
        "model": {"kind": "gpt", "layers": 2, "d_model": 32, "heads": 2, "seq_len": 16},
        "train": {"batch_size": 8, **train},
        "parallel": parallel,
    }


ACCEPTED = [
    ({"data_parallel": 2}, 2),
    ({"pipeline": PIPE, "data_parallel": 2}, 4),
    ({"pipeline": PIPE, "tensor": {"mode": "1d", "size": 2}}, 4),
    ({"tensor": {"mode": "2d", "q": 2}, "data_parallel": 2}, 8),
    ({"pipeline": PIPE, "offload": {"optimizer": True}}, 2),
    (
        {
            "pipeline": PIPE,
            "tensor": {"mode": "1d", "size": 2},
            "data_parallel": 2,
            "offload": {"optimizer": True},
        },
        8,
    ),
    ({"tensor": {"mode": "2.5d", "q": 2, "d": 2}}, 8),
]

REFUSED = [
    ({"data_parallel": 3}, "train.batch_size (8) must be divisible by parallel.data_parallel (3)"),
    (
        {"pipeline": {"stages": 2, "microbatches": 4}, "data_parallel": 4},
        "parallel.pipeline.microbatches (4) must divide a replica's rows",
    ),
    (
        {"tensor": {"mode": "2d", "q": 2}, "data_parallel": 8},
        "a replica's rows (1) must be divisible by q (2)",
    ),
    (
        {"tensor": {"mode": "2.5d", "q": 2, "d": 2}, "data_parallel": 4},
        "a replica's rows (2) must be divisible by d*q (4)",
    ),
    ({"spill": {"device_budget_mb": 64}, "pipeline": PIPE}, "parallel.spill runs on one process only"),
    ({"spill": {"device_budget_mb": 64}, "data_parallel": 2}, "parallel.spill runs on one process only"),
    ({"pipeline": PIPE, "offload": {"optimizer": True, "dtype": "fp16"}}, "parallel.offload.dtype fp16"),
    ({"pipeline": {"stages": 3, "microbatches": 2, "schedule": "chimera"}}, "must be even for chimera"),
    ({"tensor": {"mode": "1d", "size": 3}}, "model.heads (2) must be divisible by parallel.tensor.size (3)"),
]


@pytest.mark.parametrize(("parallel", "ranks"), ACCEPTED)
def test_accepted_combinations_pass_both_sides_with_one_world_size(parallel: dict, ranks: int) -> None:
    api = JobSpec.model_validate(spec(parallel))
    cfg = load_job(api.model_dump())
    assert api.parallel.world_size == cfg.parallel.world_size == world_size(parallel) == ranks


@pytest.mark.parametrize(("parallel", "needle"), REFUSED)
def test_refused_combinations_fail_both_sides_with_the_same_words(parallel: dict, needle: str) -> None:
    raw = spec(parallel)
    assert any(needle in p for p in parallel_problems(raw)), parallel_problems(raw)
    with pytest.raises(ValidationError) as api_err:
        JobSpec.model_validate(raw)
    with pytest.raises(SpecError) as cfg_err:
        load_job(raw)
    assert needle in str(api_err.value) and needle in str(cfg_err.value)


def test_the_trainer_cli_exits_2_with_the_rule(tmp_path: Path) -> None:
    path = tmp_path / "spec.json"
    path.write_text(json.dumps(spec({"spill": {"device_budget_mb": 64}, "data_parallel": 2})))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "-m", "trainer", "--spec", str(path)],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=120,
    )
    assert proc.returncode == 2
    (line,) = [json.loads(x) for x in proc.stdout.splitlines()]
    assert line["kind"] == "error" and "parallel.spill runs on one process only" in line["message"]


def test_the_host_memory_estimate_sizes_a_model_that_follows_its_datas_vocabulary() -> None:
    """A default JobSpec leaves model.vocab_size out (it follows the data): admission must size it
    with the data's vocabulary, not fail on the missing number (it was a 500 at submit)."""
    from jobrules.hostmem import host_memory_bytes

    dumped = JobSpec.model_validate(spec({"data_parallel": 2})).model_dump()
    assert dumped["model"].get("vocab_size") is None
    explicit = JobSpec.model_validate(
        {**spec({"data_parallel": 2}), "model": {**spec({})["model"], "vocab_size": 128}}
    )
    assert host_memory_bytes(dumped) == host_memory_bytes(explicit.model_dump())
    assert host_memory_bytes(dumped)["model_state"] > 0
