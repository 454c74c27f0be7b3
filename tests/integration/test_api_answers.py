"""What the API sends is what its OpenAPI schema declares, on a real stack (the API under uvicorn,
no worker): the 422 of hostile requests, whoever refuses them (FastAPI's validation, the request
limits in front of it, a route's own check), is the ValidationRefusal /openapi.json names for that
route; and a job or batch stored by an older version (a spec without today's fields, a key since
retired) reads back unchanged, never a 500."""

from __future__ import annotations

import copy
import json
from collections.abc import Iterator
from typing import Any

import httpx
import jsonschema
import pytest
from fastapi.openapi.utils import validation_error_definition, validation_error_response_definition

from api.limits import MAX_INT_DIGITS, MAX_JSON_DEPTH
from api.stack import Stack
from db.connection import session_for
from db.jobs import create_job
from db.models import Job, Selection
from db.selections import create_selection
from tests.conftest import TINY_SPEC, StackHandle, running

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def api(tmp_path_factory: pytest.TempPathFactory) -> Iterator[StackHandle]:
    with running(Stack(root=tmp_path_factory.mktemp("answers"), workers=0)) as handle:
        yield handle


def declared_422(openapi: dict[str, Any], method: str, path: str) -> jsonschema.Draft202012Validator:
    """A validator of the route's declared 422 body, its $refs resolved in the whole document."""
    answer = openapi["paths"][path][method]["responses"]["422"]
    schema = answer["content"]["application/json"]["schema"]
    assert schema == {"$ref": "#/components/schemas/ValidationRefusal"}, (method, path, schema)
    return jsonschema.Draft202012Validator({**schema, "components": openapi["components"]})


def fastapis_own_422() -> jsonschema.Draft202012Validator:
    """The body FastAPI declares by default (a list of {loc, msg, type}), which the API never sent."""
    defs = {
        "HTTPValidationError": validation_error_response_definition,
        "ValidationError": validation_error_definition,
    }
    return jsonschema.Draft202012Validator(
        {"$ref": "#/components/schemas/HTTPValidationError", "components": {"schemas": defs}}
    )


def nested(depth: int) -> str:
    return "[" * depth + "]" * depth


HOSTILE: list[tuple[str, str, str, dict[str, Any], str | None]] = [
    # (method, route in the schema, URL, request arguments, the field the refusal names)
    ("post", "/api/jobs", "/api/jobs", {"json": {**TINY_SPEC, "train": {"lr": -1}}}, "train.lr"),
    ("post", "/api/jobs", "/api/jobs", {"json": {**TINY_SPEC, "model": {"colour": "red"}}}, "model.colour"),
    ("post", "/api/jobs", "/api/jobs", {"json": [1, 2]}, "body"),
    (
        "post",
        "/api/jobs",
        "/api/jobs",
        {"content": "{", "headers": {"Content-Type": "application/json"}},
        "body",
    ),
    # the request limits refuse these before FastAPI reads them
    (
        "post",
        "/api/jobs",
        "/api/jobs",
        {"content": nested(MAX_JSON_DEPTH + 5), "headers": {"Content-Type": "application/json"}},
        None,
    ),
    (
        "post",
        "/api/jobs",
        "/api/jobs",
        {
            "content": '{"priority": ' + "9" * (MAX_INT_DIGITS + 10) + "}",
            "headers": {"Content-Type": "application/json"},
        },
        "priority",
    ),
    ("get", "/api/jobs", "/api/jobs?limit=0", {}, "limit"),
    ("get", "/api/jobs", "/api/jobs?status=lost", {}, "status"),
    ("get", "/api/jobs/{job_id}", "/api/jobs/0", {}, "job_id"),
    ("get", "/api/selections", "/api/selections?status=lost&limit=9999", {}, "status"),
    ("get", "/api/selections/{selection_id}", "/api/selections/99999999999", {}, "selection_id"),
    ("post", "/api/selections", "/api/selections", {"json": {"base": TINY_SPEC, "space": {}}}, "space"),
    # a route's own check: the space names a field no JobSpec has (detail only, no errors list)
    (
        "post",
        "/api/selections",
        "/api/selections",
        {"json": {"base": TINY_SPEC, "space": {"train.colour": [1, 2]}, "method": "grid"}},
        None,
    ),
    ("post", "/api/selections/{selection_id}/trials", "/api/selections/1/trials", {"json": {}}, "body"),
]


def test_every_422_is_the_declared_refusal(api: StackHandle) -> None:
    openapi = api.client.get("/openapi.json").json()
    assert "HTTPValidationError" not in json.dumps(openapi)
    fastapi_shape = fastapis_own_422()
    for method, route, url, kwargs, field in HOSTILE:
        resp = api.client.request(method.upper(), url, **kwargs)
        assert resp.status_code == 422, (method, url, resp.status_code, resp.text[:300])
        body = resp.json()
        problems = sorted(declared_422(openapi, method, route).iter_errors(body), key=str)
        assert not problems, (url, body, [p.message for p in problems])
        # the check tells the shapes apart: FastAPI's default declaration does not fit what is sent
        assert not fastapi_shape.is_valid(body), (url, body)
        assert body["detail"], (url, body)
        if field is not None:
            assert field in [e["field"] for e in body.get("errors", [])] or body["detail"].startswith(
                field
            ), (
                url,
                body,
            )


# A JobSpec as an early version stored it: none of the fields added since (workspace,
# max_runtime_s, max_restarts, env, model.kv_heads/entry/args/init_from, data.dtype/entry/args,
# train.grad_clip, parallel.offload/tensor), and a key no version knows today
OLD_SPEC: dict[str, Any] = {
    "name": "from-an-old-version",
    "model": {
        "kind": "gpt",
        "layers": 2,
        "d_model": 32,
        "heads": 2,
        "seq_len": 32,
        "vocab_size": None,
        "mlp_ratio": 4,
    },
    "data": {"kind": "text", "corpus": "stdlib", "path": None, "tokenizer": "char", "max_chars": 200000},
    "train": {"steps": 40, "batch_size": 8, "lr": 0.003, "optimizer": "adamw", "seed": 0, "eval_every": 20},
    "parallel": {"spill": None, "pipeline": None, "data_parallel": 1},
    "resources": {"device": "cpu", "gpus": 0},
    "checkpoint_every": 0,
    "priority": 0,
    "retired_knob": True,
}
OLD_REQUEST: dict[str, Any] = {
    "name": "old-batch",
    "base": OLD_SPEC,
    "space": {"train.lr": [0.001, 0.01]},
    "method": "grid",
    "seed": 0,
    "metric": "val_loss",
    "mode": "min",
    "devices": 2,
}


def test_a_job_and_a_batch_stored_by_an_older_version_read_unchanged(api: StackHandle) -> None:
    with session_for(api.stack.database_url) as s:
        job = create_job(s, name=OLD_SPEC["name"], spec=copy.deepcopy(OLD_SPEC), steps=40)
        job.status = "succeeded"
        sel = create_selection(
            s,
            name="old-batch",
            request=copy.deepcopy(OLD_REQUEST),
            metric="val_loss",
            mode="min",
            scheduler="fifo",
        )
        sel.status = "succeeded"
        s.commit()
        job_id, sel_id = job.id, sel.id
        assert s.get(Job, job_id).spec == OLD_SPEC and s.get(Selection, sel_id).request == OLD_REQUEST

    one = api.client.get(f"/api/jobs/{job_id}")
    assert one.status_code == 200, one.text
    assert one.json()["spec"] == OLD_SPEC  # sent as stored: no field added, none dropped
    listed = api.client.get("/api/jobs", params={"name": "from-an-old"})
    assert listed.status_code == 200, listed.text
    assert [j["spec"] for j in listed.json()["items"]] == [OLD_SPEC]

    got = api.client.get(f"/api/selections/{sel_id}")
    assert got.status_code == 200, got.text
    assert got.json()["request"] == OLD_REQUEST
    assert got.json()["space"] == OLD_REQUEST["space"]
    page = api.client.get("/api/selections", params={"name": "old-batch", "status": "succeeded"})
    assert page.status_code == 200, page.text
    assert [x["request"] for x in page.json()["items"]] == [OLD_REQUEST]
    # today's rules refuse the stored request (the retired key): the batch cannot grow, and says so
    grow = api.client.post(f"/api/selections/{sel_id}/trials", json={"trials": 1})
    assert grow.status_code == 409, grow.text
    assert "retired_knob" in grow.json()["detail"], grow.text


def test_the_schema_served_names_the_stored_documents(api: StackHandle) -> None:
    schemas = httpx.get(f"{api.base_url}/openapi.json", timeout=30).json()["components"]["schemas"]
    assert schemas["JobPublic"]["properties"]["spec"]["$ref"] == "#/components/schemas/JobSpec"
    assert (
        schemas["SelectionPublic"]["properties"]["request"]["$ref"] == "#/components/schemas/SelectionCreate"
    )
