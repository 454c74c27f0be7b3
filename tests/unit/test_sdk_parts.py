"""The SDK's parts that need no server: error bodies turned into words that name the field, the
SSE framing, request documents from models, and workspace archives."""

from __future__ import annotations

import io
import tarfile
import zipfile
from pathlib import Path

import httpx
import pytest

from jobrules.spec import JobSpec
from shardyard.client import _document
from shardyard.errors import ApiError, ShardyardError, raise_for, readable_detail
from shardyard.results import Job, Selection
from shardyard.stream import Frame, _parse
from shardyard.workspace import archive_body


def test_the_apis_422_keeps_its_words_and_fields() -> None:
    body = {
        "detail": "train.lr: Input should be greater than 0",
        "errors": [
            {"field": "train.lr", "message": "Input should be greater than 0", "type": "greater_than"}
        ],
    }
    resp = httpx.Response(422, json=body)
    with pytest.raises(ApiError) as e:
        raise_for(resp)
    assert str(e.value) == "422: train.lr: Input should be greater than 0"
    assert e.value.status == 422 and e.value.fields == ["train.lr"]
    assert isinstance(e.value, ShardyardError)


def test_a_bare_fastapi_list_detail_becomes_readable_text() -> None:
    body = {
        "detail": [
            {"loc": ["body", "train", "lr"], "msg": "Input should be greater than 0", "type": "greater_than"},
            {"loc": ["query", "limit"], "msg": "Value error, too big", "type": "value_error"},
        ]
    }
    message, errors = readable_detail(body, "fallback")
    assert message == "train.lr: Input should be greater than 0; limit: too big"
    assert [e["field"] for e in errors] == ["train.lr", "limit"]


def test_a_body_that_is_not_json_is_the_message() -> None:
    with pytest.raises(ApiError) as e:
        raise_for(httpx.Response(502, text="<html>bad gateway</html>"))
    assert e.value.status == 502 and "bad gateway" in e.value.message and e.value.fields == []
    raise_for(httpx.Response(200, json={}))  # a success raises nothing


def test_sse_frames_as_the_api_writes_them() -> None:
    lines = [
        "retry: 2000",
        "",
        ": keep-alive",
        "",
        "id: m5e3",
        "event: metric",
        'data: {"step":1,"name":"loss","value":2.5,"time":1.0}',
        "",
        "event: log",
        'data: {"message":"hi","time":2.0,"rank":0,"stream":"stdout"}',
        "",
    ]
    assert list(_parse(iter(lines), deadline=None)) == [
        Frame(id="m5e3", event="metric", data={"step": 1, "name": "loss", "value": 2.5, "time": 1.0}),
        Frame(id=None, event="log", data={"message": "hi", "time": 2.0, "rank": 0, "stream": "stdout"}),
    ]


def test_a_request_from_a_model_carries_only_what_was_set() -> None:
    spec = JobSpec.model_validate({"name": "m", "train": {"steps": 3}})
    assert _document(spec, "spec") == {"name": "m", "train": {"steps": 3}}
    assert _document({"name": "d"}, "spec") == {"name": "d"}
    with pytest.raises(TypeError, match="spec: a dict or a pydantic model, not list"):
        _document([1], "spec")


def test_workspace_folders_and_archives(tmp_path: Path) -> None:
    folder = tmp_path / "code"
    (folder / "pkg").mkdir(parents=True)
    (folder / "pkg" / "m.py").write_text("x = 1\n")
    (folder / "__pycache__").mkdir()
    (folder / "__pycache__" / "junk.pyc").write_bytes(b"\0")
    body, kind = archive_body(folder)
    assert kind == "application/gzip"
    with tarfile.open(fileobj=io.BytesIO(body), mode="r:gz") as tar:
        assert tar.getnames() == ["pkg/m.py"]
    # a plain .tar is gzipped (the API reads .tar.gz and .zip), a .zip goes as it is
    plain = tmp_path / "code.tar"
    with tarfile.open(plain, "w") as tar:
        tar.add(folder / "pkg" / "m.py", arcname="m.py")
    body, kind = archive_body(plain)
    assert kind == "application/gzip" and body[:2] == b"\x1f\x8b"
    with tarfile.open(fileobj=io.BytesIO(body), mode="r:gz") as tar:
        assert tar.getnames() == ["m.py"]
    zipped = tmp_path / "code.zip"
    with zipfile.ZipFile(zipped, "w") as z:
        z.writestr("m.py", "x = 1\n")
    assert archive_body(zipped) == (zipped.read_bytes(), "application/zip")
    other = tmp_path / "notes.txt"
    other.write_text("hello")
    with pytest.raises(ShardyardError, match="neither a folder nor a .tar, .tar.gz or .zip"):
        archive_body(other)
    (folder / "link").symlink_to(folder / "pkg" / "m.py")
    with pytest.raises(ShardyardError, match="link is a symlink"):
        archive_body(folder)


def test_results_without_a_client_say_so() -> None:
    job = Job.from_json(
        {"id": 7, "name": "j", "status": "queued", "created_at": "2026-01-01T00:00:00Z", "progress": {}}
    )
    assert job.progress.step == 0 and not job.done and job.created_at.year == 2026
    with pytest.raises(RuntimeError, match="job 7 was not read through a Client"):
        job.wait()
    sel = Selection.from_json(
        {
            "id": 3,
            "name": "s",
            "status": "running",
            "created_at": "2026-01-01T00:00:00+00:00",
            "trials": [
                {"id": 10, "index": 0, "status": "running", "job_id": 1, "best_metric": 2.0},
                {"id": 11, "index": 1, "status": "running", "job_id": 2, "best_metric": 1.0},
                {"id": 12, "index": 2, "status": "queued", "job_id": 3},
            ],
            "leaderboard": [11, 10],
        }
    )
    assert [(r.rank, r.trial.id, r.best) for r in sel.leaderboard] == [(1, 11, 1.0), (2, 10, 2.0)]
    assert sel.best is not None and sel.best.index == 1
