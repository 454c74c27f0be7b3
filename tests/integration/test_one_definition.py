"""Every rule of a request, from its one definition (jobrules/spec.py), gives the same answer at the
API (422) and in the trainer (`python -m trainer --spec` exits 2; a selection group's batch is
refused by trainer.selection's parse_batch), in the same words.

The cases are read off the models themselves: every bound of every field (one value past each
end), every allowed-values field (a value outside them), and then the cross-field rules by hand. A
new field with a bound is exercised without touching this file; a rule that one side checks and the
other does not fails here (one side answers, the other does not)."""

from __future__ import annotations

import copy
import json
import re
import subprocess
import sys
import types
import typing
from pathlib import Path
from typing import Any

import annotated_types as at
import pytest
from pydantic import BaseModel

from jobrules.spec import BatchRules, JobSpec, SpecError
from tests.conftest import TINY_SPEC, StackHandle
from trainer.__main__ import main as trainer_main
from trainer.selection.job import parse_batch

pytestmark = pytest.mark.integration

# sub-objects that are absent by default: a valid one to put a bad field into
PRESENT = {
    "parallel.spill": {"device_budget_mb": 1000.0},
    "parallel.offload": {},
    "parallel.pipeline": {},
    "parallel.tensor": {},
    "env": {},
    "early_stopping": {},
}


def _model_of(annotation: Any) -> type[BaseModel] | None:
    for a in (annotation, *typing.get_args(annotation)):
        if isinstance(a, type) and issubclass(a, BaseModel):
            return a
    return None


def _choices(annotation: Any) -> tuple[Any, ...]:
    if typing.get_origin(annotation) is typing.Literal:
        return typing.get_args(annotation)
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return tuple(c for a in typing.get_args(annotation) for c in _choices(a))
    return ()


def _past_bounds(metadata: list[Any]) -> list[tuple[Any, str]]:
    """(value, rule) one step past each bound of a field."""
    out: list[tuple[Any, str]] = []
    for m in metadata:
        if isinstance(m, at.Ge):
            out.append((m.ge - 1, f">= {m.ge}"))
        elif isinstance(m, at.Gt):
            out.append((m.gt, f"> {m.gt}"))
        elif isinstance(m, at.Le):
            out.append((m.le * 2 if isinstance(m.le, float) else m.le + 1, f"<= {m.le}"))
        elif isinstance(m, at.Lt):
            out.append((m.lt, f"< {m.lt}"))
        # annotated_types' MinLen/MaxLen, or pydantic's StringConstraints (a Name)
        elif getattr(m, "min_length", None):
            out.append(("", f"length >= {m.min_length}"))
        if getattr(m, "max_length", None) is not None:
            out.append(("x" * (m.max_length + 1), f"length <= {m.max_length}"))
    return out


def field_cases(model: type[BaseModel], prefix: str = "") -> list[tuple[str, Any, str]]:
    """(dotted field, bad value, rule) for every bound and allowed-values field under `model`."""
    cases: list[tuple[str, Any, str]] = []
    for name, info in model.model_fields.items():
        path = f"{prefix}{name}"
        sub = _model_of(info.annotation)
        if sub is not None:
            cases += field_cases(sub, f"{path}.")
            continue
        if choices := _choices(info.annotation):
            cases.append((path, "no-such-choice", f"one of {choices}"))
        text = str in (info.annotation, *typing.get_args(info.annotation))
        for value, rule in _past_bounds(info.metadata):
            if text or not isinstance(value, str):  # a list's length is not probed with a string
                cases.append((path, value, rule))
        for m in info.metadata:
            pattern = getattr(m, "pattern", None)
            if pattern and re.search(pattern, "no-such-choice") is None:
                cases.append((path, "no-such-choice", f"matches {pattern}"))
    return cases


def with_(base: dict[str, Any], path: str, value: Any) -> dict[str, Any]:
    spec = copy.deepcopy(base)
    parts = path.split(".")
    node = spec
    for i, p in enumerate(parts[:-1]):
        here = ".".join(parts[: i + 1])
        if node.get(p) is None:
            node[p] = copy.deepcopy(PRESENT.get(here, {}))
        node = node[p]
    node[parts[-1]] = value
    return spec


JOB_FIELDS = field_cases(JobSpec)
CROSS_FIELD = [
    (
        {"model": {**TINY_SPEC["model"], "heads": 3}},
        "model.d_model (32) must be divisible by model.heads (3)",
    ),
    ({"name": "   "}, "must hold a visible character"),
    ({"name": "a\x07b"}, "name: String should match pattern"),
    ({"train": {**TINY_SPEC["train"], "batch_size": 6}, "parallel": {"data_parallel": 4}}, "data_parallel"),
    ({"parallel": {"pipeline": {"stages": 2, "microbatches": 3}}}, "must divide train.batch_size (8)"),
    ({"parallel": {"pipeline": {"stages": 3, "microbatches": 4, "schedule": "chimera"}}}, "must be even"),
    ({"parallel": {"tensor": {"mode": "1d", "size": 3}}}, "must be divisible by parallel.tensor.size (3)"),
    ({"parallel": {"spill": {"device_budget_mb": 0.001}}}, "largest single layer's working set"),
    ({"parallel": {"spill": {"device_budget_mb": 100, "cuts": [3, 1]}}}, "parallel.spill.cuts ([3, 1])"),
    ({"model": {**TINY_SPEC["model"], "vocab_size": 50}}, "vocab"),
    ({"data": {"kind": "text", "path": "corpus.txt"}}, "data.path ('corpus.txt') is relative"),
    ({"model": {"kind": "python", "entry": "m:f"}}, "model.kind python needs a workspace"),
    ({"data": {"kind": "tokens"}}, "data"),
    ({"env": {"pip": ["not a requirement!"]}}, "env.pip[0]"),
    ({"env": {"pip": ["torch==1.0.0"]}}, "torch"),
    ({"max_restarts": -1}, "max_restarts: Input should be greater than or equal to 0"),
]


def trainer_answer(
    spec: dict[str, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> tuple[int, str]:
    """The trainer's own CLI, in this process (its parse and exit status), on the spec file."""
    path = tmp_path / "spec.json"
    path.write_text(json.dumps(spec))
    capsys.readouterr()
    rc = trainer_main(["--spec", str(path), "--check"])
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines() if x.strip()]
    errors = [x["message"] for x in lines if x["kind"] == "error"]
    return rc, errors[-1] if errors else ""


def api_answer(stack: StackHandle, path: str, body: dict[str, Any]) -> tuple[int, str]:
    resp = stack.client.post(path, json=body)
    return resp.status_code, resp.json().get("detail", "") if resp.status_code == 422 else ""


@pytest.mark.parametrize(
    ("change", "needle"),
    [pytest.param((path, value), rule, id=f"{path}={str(value)[:20]}") for path, value, rule in JOB_FIELDS]
    + [pytest.param(change, needle, id=needle[:40]) for change, needle in CROSS_FIELD],
)
def test_a_job_rule_answers_the_same_at_the_api_and_the_trainer(
    stack: StackHandle, tmp_path: Path, capsys: pytest.CaptureFixture[str], change: Any, needle: str
) -> None:
    if isinstance(change, tuple):
        path, value = change
        spec = with_(TINY_SPEC, path, value)
        needle = f"{path}: "  # the field is named first: "<field>: <rule>"
    else:
        spec = {**copy.deepcopy(TINY_SPEC), **change}
    status, detail = api_answer(stack, "/api/jobs", spec)
    rc, message = trainer_answer(spec, tmp_path, capsys)
    assert status == 422, f"the API took {spec}"
    assert needle in detail
    assert (rc, message) == (2, f"bad spec: {detail}")


SELECTION = {"base": TINY_SPEC, "space": {"train.lr": [0.01, 0.001]}, "method": "grid"}
BATCH_FIELDS = field_cases(BatchRules)


@pytest.mark.parametrize(
    ("path", "value"), [pytest.param(p, v, id=f"{p}={str(v)[:20]}") for p, v, _ in BATCH_FIELDS]
)
def test_a_selection_rule_answers_the_same_at_the_api_and_the_batch(
    stack: StackHandle, path: str, value: Any
) -> None:
    """The request's rules that a worker hands on to the executor (BatchRules): refused at submit,
    and refused in the same words in the batch message the trainer reads."""
    status, detail = api_answer(stack, "/api/selections", with_(SELECTION, path, value))
    batch = with_({"trials": [{"index": 0, "spec": TINY_SPEC}]}, path, value)
    with pytest.raises(SpecError) as refused:
        parse_batch(batch)
    assert status == 422 and detail.startswith(f"{path}: ")
    assert str(refused.value) == detail


def test_the_cases_cover_every_bounded_field() -> None:
    """The generated cases are not empty shells: each drifted field of the old second list is here."""
    fields = {path for path, _, _ in JOB_FIELDS}
    for path in ("train.weight_decay", "train.momentum", "train.eval_every", "train.grad_clip", "name"):
        assert path in fields
    assert {v for p, v, _ in JOB_FIELDS if p == "parallel.pipeline.schedule"} == {"no-such-choice"}
    assert {p for p, _, _ in BATCH_FIELDS} >= {
        "scheduler",
        "metric",
        "checkpoints",
        "seed",
        "early_stopping.kind",
    }


def test_the_trainer_cli_exits_2_with_the_apis_words(stack: StackHandle, tmp_path: Path) -> None:
    """The real process, once: its exit status and the error line the worker reads."""
    spec = with_(TINY_SPEC, "train.momentum", 1.0)
    status, detail = api_answer(stack, "/api/jobs", spec)
    path = tmp_path / "spec.json"
    path.write_text(json.dumps(spec))
    proc = subprocess.run(
        [sys.executable, "-m", "trainer", "--spec", str(path), "--check"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    error = json.loads(proc.stdout.splitlines()[-1])
    assert status == 422 and detail == "train.momentum: Input should be less than 1"
    assert (proc.returncode, error["kind"], error["message"]) == (2, "error", f"bad spec: {detail}")
    ok = tmp_path / "ok.json"
    ok.write_text(json.dumps(TINY_SPEC))
    assert (
        subprocess.run(
            [sys.executable, "-m", "trainer", "--spec", str(ok), "--check"], timeout=120
        ).returncode
        == 0
    )
